"""FP8 current scaling emulated from the formats' definitions, for references that check
the library's casts and GEMMs rather than reuse them."""

import json
import os

import torch

import fusible
from fusible.testing import FP8Emulation, Rounding, reference_forward, snr_db
from fp8_formats import FP8_MAX

FLOAT32_MAX = torch.finfo(torch.float32).max


def quantize_dequantize(t: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``t`` scaled so that its absolute maximum maps to the format's largest value
    (a float32 scale, at most the largest float32; 1 for an all-zero tensor), rounded to
    the format, and scaled back, in ``t``'s dtype."""
    limit = FP8_MAX[fp8_dtype]
    amax = t.detach().abs().max().float()
    scale = amax.new_full((), limit) / amax if amax > 0 else amax.new_ones(())
    scale = scale.clamp(max=FLOAT32_MAX)
    data = (t.detach().float() * scale).clamp(-limit, limit).to(fp8_dtype)
    return (data.double() * (1 / scale).double()).to(t.dtype)


def emulation(recipe) -> FP8Emulation:
    """The reference's FP8 GEMM operands under ``recipe`` (its formats, our constants)."""
    return FP8Emulation(recipe, lambda t: quantize_dequantize(t, recipe.forward_dtype),
                        lambda t: quantize_dequantize(t, recipe.backward_dtype))


def log_snrs(snrs: dict) -> None:
    """Append the reached SNRs to the file ``$SNR_LOG`` names, if any: how floors are
    calibrated on new hardware (``scripts/gpu_check.sh`` collects them)."""
    path = os.environ.get("SNR_LOG")
    if path:
        with open(path, "a") as log:
            log.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "?"),
                                  "snrs": {k: round(v, 2) for k, v in snrs.items()}}) + "\n")


def assert_snrs_above(snrs: dict, floor_db: float, what: str = "") -> None:
    """Log the reached SNRs (:func:`log_snrs`) and fail naming every one not above
    ``floor_db``, with all of them for context."""
    log_snrs({f"{what}: {k}" if what else k: v for k, v in snrs.items()})
    low = {k: round(v, 1) for k, v in snrs.items() if not v > floor_db}
    if low:
        raise AssertionError(f"{what + ': ' if what else ''}below {floor_db} dB: {low} "
                             f"(all: { {k: round(v, 1) for k, v in snrs.items()} })")


class _GradThrough(torch.autograd.Function):
    """The value as is; its gradient through ``fn`` (what a consumer sends back)."""

    @staticmethod
    def forward(ctx, t, fn):
        ctx.fn = fn
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return ctx.fn(grad), None


def check_against_emulation(model, inputs, run, recipe, floor_db, output_grad=None,
                             leaves=None):
    """Run ``run(*inputs)`` under ``recipe`` and back-propagate a random gradient; compare
    the outputs and every gradient (inputs, parameters) with the emulated FP64 reference:
    GEMM operands quantized with the formats' constants, stages rounded where the plan
    rounds. ``output_grad(t)``: what the consumer of a quantized output sends back;
    ``leaves``: the tensors whose ``.grad`` is each input's gradient (default: the inputs).
    Returns the SNRs (dB) by result."""
    low = inputs[0].dtype
    with fusible.autocast(recipe=recipe):
        plan = model.plan(*inputs)
        outputs = run(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(o.shape, generator=gen, device="cpu").to(o.device, low)
             for o in outputs]
    torch.autograd.backward([o.dequantize() if isinstance(o, fusible.Float8Tensor) and
                             output_grad is None else o for o in outputs], grads)
    ref_inputs = [(t.dequantize() if isinstance(t, fusible.Float8Tensor) else t)
                  .detach().double().requires_grad_(t.requires_grad) for t in inputs]
    ref_outputs, ref_params = reference_forward(model, *ref_inputs, fp8=emulation(recipe),
                                                rounding=Rounding.of_plan(plan, low))
    ref_outputs = ref_outputs if isinstance(ref_outputs, tuple) else (ref_outputs,)
    if output_grad is not None:
        ref_outputs = tuple(_GradThrough.apply(r, output_grad) for r in ref_outputs)
    torch.autograd.backward(ref_outputs, [g.double() for g in grads])
    results = {f"output {i}": (o, r) for i, (o, r) in enumerate(zip(outputs, ref_outputs))}
    results.update({f"input {i} grad": (t.grad, r.grad)
                    for i, (t, r) in enumerate(zip(leaves or inputs, ref_inputs))
                    if t.requires_grad})
    results.update({f"{n} grad": (p.grad, ref_params[id(p)].grad)
                    for n, p in model.named_parameters() if p.requires_grad})
    snrs = {what: snr_db(got, want) for what, (got, want) in results.items()}
    assert_snrs_above(snrs, floor_db)
    return snrs
