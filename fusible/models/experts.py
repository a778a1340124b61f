"""Mixture-of-experts expert banks as fusible grouped GEMMs: a module holding every
expert's weights as 3-D tensors, ``gate_up_proj`` ``(experts, 2 * intermediate, hidden)``
and ``down_proj`` ``(experts, hidden, intermediate)``, with a SiLU ``act_fn``, called
``experts(hidden_states, top_k_index, top_k_weights)`` (transformers' ``MixtralExperts``,
``Qwen3MoeExperts``, ``Qwen2MoeExperts``, ``DeepseekV3Experts``...), runs as
:func:`fusible.moe.permute_tokens`, ``GroupedLinear -> SwiGLU -> GroupedLinear`` and
:func:`fusible.moe.unpermute_tokens`.

Only the experts change: the model's router (its scores, top-k, normalisation, grouped
routing, the logits its load-balancing loss reads) and its shared experts run their own
code. The module keeps its class and parameters (an optimizer built before the conversion
trains them: the grouped GEMMs read the 3-D weights as they are, no copy); the installed
forward calls the grouped pipeline (on the meta device, holding nothing) with them through
``torch.func.functional_call``. A routing entry equal to the number of experts (transformers'
"no expert") contributes nothing, as in the original loop. The counts per expert stay on
the device: a compiled model does not recompile when the routing changes. Under FP8
(``fusible.autocast``) each expert's rows are padded to a multiple of 16, which FP8
grouped GEMMs need.
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Union

import torch
from torch import nn

from fusible import moe, ops
from fusible.models.installed_forward import InstalledForward
from fusible.models.probed_modules import PROBE_TOLERANCE, probed_module
from fusible.quantization.gemm_policy import gemm_decision
from fusible.quantization.recipes.autocast import fp8_recipe

# The plain attributes of transformers' expert banks, with the values the grouped pipeline
# computes (transformers' own grouped implementations read these flags); any other (a
# SwiGLU clamp's ``limit``, an ``alpha``) means other arithmetic: the bank stays
_KNOWN = {"training": None, "num_experts": None, "hidden_dim": None, "intermediate_dim": None,
          "config": None, "has_gate": True, "has_bias": False, "has_post_expert_norm": False,
          "is_transposed": False, "is_concatenated": True}


def fuse_experts(module: Any) -> Union[None, str, "FusedExpertsForward"]:
    """Install the fused forward on ``module`` if it is an expert bank (see the module
    notes). None: not one; a str: one, and why it stays; the installed forward otherwise."""
    if "forward" in module.__dict__:
        return None
    shape = _bank_shape(module)
    if shape is None:
        return None
    if not isinstance(probed_module(module.act_fn), ops.SiLU):
        return f"its act_fn ({type(module.act_fn).__name__}) does not compute SiLU"
    others = sorted((set(module._parameters) - {"gate_up_proj", "down_proj"})
                    | (set(module._modules) - {"act_fn"}) | set(module._buffers)
                    | {k for k in vars(module) if not k.startswith("_") and k not in _KNOWN})
    if others:
        return f"it holds more than the experts' two weights and act_fn ({', '.join(others)})"
    flags = {k: vars(module)[k] for k, v in _KNOWN.items()
             if v is not None and k in vars(module) and vars(module)[k] != v}
    if flags:
        return f"its layout flags {flags} are not the grouped pipeline's"
    fused = FusedExpertsForward(module, *shape)
    why = fused.probe()
    if why:
        return why
    module.forward = fused
    return fused


def _bank_shape(module: nn.Module) -> Optional[tuple]:
    """``(experts, hidden, intermediate, dtype)`` of an expert bank, else None."""
    gate_up = module._parameters.get("gate_up_proj")
    down = module._parameters.get("down_proj")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3 or \
            not hasattr(module, "act_fn"):
        return None
    experts, twice, hidden = gate_up.shape
    if twice % 2 or tuple(down.shape) != (experts, hidden, twice // 2):
        return None
    return experts, hidden, twice // 2, gate_up.dtype


class FusedExpertsForward(InstalledForward):
    """The forward :func:`fuse_experts` installs.

    Attributes
    ----------
    fused : fusible.ops.Sequential
        ``GroupedLinear(experts, hidden, 2 * intermediate) -> SwiGLU ->
        GroupedLinear(experts, intermediate, hidden)`` on the meta device, called with the
        module's two weights.
    """

    def __init__(self, module: nn.Module, experts: int, hidden: int, intermediate: int,
                 dtype: torch.dtype):
        super().__init__(module)
        self.num_experts = experts
        meta: dict[str, Any] = {"device": "meta", "dtype": dtype}
        self.fused = ops.Sequential(ops.GroupedLinear(experts, hidden, 2 * intermediate,
                                                         **meta),
                                       ops.SwiGLU(),
                                       ops.GroupedLinear(experts, intermediate, hidden, **meta))

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        return self.run(self._owner(), hidden_states, top_k_index, top_k_weights)

    def run(self, module: Any, x, top_k_index, top_k_weights):
        """The experts' combined output ``(tokens, hidden)`` for the routing given."""
        none = top_k_index == self.num_experts  # "no expert": contributes nothing
        index = torch.where(none, 0, top_k_index)
        weights = torch.where(none, 0, top_k_weights)
        rows, routing = moe.permute_tokens(x, index, self.num_experts,
                                           align=self._alignment(x.device.type))
        if self.fused.training != module.training:
            self.fused.train(module.training)
        params = {"0.weight": module.gate_up_proj, "2.weight": module.down_proj}
        y = torch.func.functional_call(self.fused, params, (rows, routing.splits,
                                                               routing.splits))
        return moe.unpermute_tokens(y, routing, weights).to(x.dtype)

    def _alignment(self, device_type: str) -> int:
        """Rows per expert a multiple of 16 where a grouped GEMM runs in FP8 (its weight
        gradient's slices), else 1 (the FP8 policy may keep the experts in bf16)."""
        recipe = fp8_recipe()
        fp8 = recipe is not None and any(gemm_decision(recipe, op, device_type) is None
                                         for op in (self.fused[0], self.fused[2]))
        return 16 if fp8 else 1

    def probe(self) -> Optional[str]:
        """Compute random routings both ways on float32 copies; why they differ, or
        None."""
        module: Any = self._owner()
        if module.gate_up_proj.device.type == "meta":
            return "its weights are on the meta device: nothing to probe them with"
        probed: Any = copy.deepcopy(module).float()
        generator = torch.Generator(module.gate_up_proj.device).manual_seed(0)
        device = module.gate_up_proj.device
        tokens, k = 12, min(2, self.num_experts)
        x = torch.randn(tokens, probed.gate_up_proj.shape[-1], generator=generator,
                        device=device)
        x = x * torch.logspace(0, 3, tokens, device=device)[:, None]  # large ones meet clamps
        index = torch.rand(tokens, self.num_experts, generator=generator,
                           device=device).argsort(-1)[:, :k]
        weights = torch.rand(tokens, k, generator=generator, device=device)
        with torch.no_grad():
            want = type(module).forward(probed, x, index, weights)
            got = FusedExpertsForward(probed, self.num_experts, x.shape[-1],
                                      probed.down_proj.shape[-1], torch.float32).run(
                probed, x, index, weights)
        error = (got - want).abs().max().item()
        bound = PROBE_TOLERANCE * want.abs().max().item()  # as a probed module's
        if not error <= bound:
            return (f"it computes other than the grouped experts on a probe input (max "
                    f"error {error:.3g}, tolerance {bound:.3g})")
        return None

    def __reduce__(self):
        module = self._owner()
        experts, hidden, intermediate, dtype = _bank_shape(module) or (0, 0, 0, None)
        return FusedExpertsForward, (module, experts, hidden, intermediate, dtype)
