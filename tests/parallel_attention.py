"""Attention heads split over a tensor-parallel group, and whole TransformerLayers under
tensor (and sequence) parallelism, against the unsplit model in float64 (run by
tests/test_parallel.py on every rank)."""

import attrs
import pytest
import torch

import fusible
from fusible import ops
from fusible.functional import parallel
from fusible.ops import BackwardResult, ForwardResult
from fusible.layers import TransformerLayer, qkv_rows_by_kind, qkv_rows_by_rank
from fusible.testing import assert_close
from parallel_layers import _part

HEADS, KV, D, HIDDEN, FFN, B, S = 4, 2, 8, 32, 48, 2, 5


def _backward(model, x, dy):
    x = x.clone().requires_grad_()
    y = model(x)
    y.backward(dy)
    return y, x.grad


def check_attention_heads_split(rank, ws):
    """QKV column-parallel (rows rank by rank), the heads split, the output projection
    row-parallel: each rank's outputs and gradients are the unsplit block's (its slices for
    the split parameters; the q/k norm weights' gradients summed over the group), eager
    and compiled."""
    torch.manual_seed(0)
    width = (HEADS + 2 * KV) * D
    options = dict(num_kv_heads=KV, rotary_base=1e4, qk_norm=True, head_dim=D)
    full = ops.Sequential(ops.Linear(HIDDEN, width), ops.Attention(HEADS, **options),
                          ops.Linear(HEADS * D, HIDDEN)).double()
    with torch.no_grad():
        full[1].q_norm_weight.uniform_(0.5, 1.5)
        full[1].k_norm_weight.uniform_(0.5, 1.5)
    x, dy = torch.randn(B, S, HIDDEN).double(), torch.randn(B, S, HIDDEN).double()
    y_ref, dx_ref = _backward(full, x, dy)
    model = ops.Sequential(
        ops.Linear(HIDDEN, width, tensor_parallel_mode="column"),
        ops.Attention(HEADS, tensor_parallel=True, **options),
        ops.Linear(HEADS * D, HIDDEN, tensor_parallel_mode="row")).double()
    rows, cols = _part(width, rank, ws), _part(HEADS * D, rank, ws)

    def by_rank(t):
        return qkv_rows_by_rank(t, HEADS, KV, ws)

    with torch.no_grad():
        model[0].weight.copy_(by_rank(full[0].weight)[rows])
        model[0].bias.copy_(by_rank(full[0].bias)[rows])
        model[1].load_state_dict(full[1].state_dict())
        model[2].weight.copy_(full[2].weight[:, cols])
        model[2].bias.copy_(full[2].bias)
    for run in (model, torch.compile(model, backend="aot_eager", fullgraph=True)):
        y, dx = _backward(run, x, dy)
        assert_close(y, y_ref, torch.float64, "y")
        assert_close(dx, dx_ref, torch.float64, "dx")
        assert_close(model[0].weight.grad, by_rank(full[0].weight.grad)[rows], torch.float64,
                     "qkv weight grad")
        assert_close(model[2].weight.grad, full[2].weight.grad[:, cols], torch.float64,
                     "proj weight grad")
        for name in ("q_norm_weight", "k_norm_weight"):  # summed over every rank's heads
            assert_close(getattr(model[1], name).grad, getattr(full[1], name).grad,
                         torch.float64, name)
        model.zero_grad()
    assert torch.equal(qkv_rows_by_kind(by_rank(full[0].weight), HEADS, KV, ws),
                       full[0].weight)
    if ws > 1:
        unsplit = ops.Sequential(ops.Linear(HIDDEN, width, tensor_parallel_mode="column"),
                                 ops.Attention(HEADS, **options)).double()
        with pytest.raises(ValueError, match=r"after the column-parallel .* Split the heads "
                                             r"too: construct the attention with "
                                             r"tensor_parallel=True"):
            unsplit(x)
        with pytest.raises(ValueError, match="num_heads and num_kv_heads must divide by 2"):
            ops.Attention(HEADS, num_kv_heads=1, tensor_parallel=True, head_dim=D)


def _layer_shards(state: dict, rank: int, ws: int) -> dict:
    """This rank's state dict of a tensor-parallel layer, from the unsplit layer's."""
    out = {}
    for name, t in state.items():
        if name.startswith("qkv."):
            t = qkv_rows_by_rank(t, HEADS, KV, ws)[_part(t.shape[0], rank, ws)]
        elif name.startswith("fc1."):
            t = fusible.interleave_glu_rows(t, FFN // ws)[_part(t.shape[0], rank, ws)]
        elif name in ("proj.weight", "fc2.weight"):
            t = t[:, _part(t.shape[1], rank, ws)]
        out[name] = t
    return out


def check_transformer_layer_tensor_parallel(rank, ws, sequence_parallel):
    """A whole layer split over the group equals the unsplit layer (with sequence
    parallelism each rank holds its batch rows between the layers)."""
    torch.manual_seed(0)
    full = TransformerLayer(HIDDEN, FFN, HEADS, num_kv_heads=KV, bias=True,
                            dtype=torch.float64)
    layer = TransformerLayer(HIDDEN, FFN, HEADS, num_kv_heads=KV, bias=True,
                             tensor_parallel=True, sequence_parallel=sequence_parallel,
                             dtype=torch.float64)
    layer.load_state_dict(_layer_shards(full.state_dict(), rank, ws))
    x, dy = torch.randn(B, S, HIDDEN).double(), torch.randn(B, S, HIDDEN).double()
    y_ref, dx_ref = _backward(full, x, dy)
    mine = _part(B, rank, ws) if sequence_parallel else slice(None)
    y, dx = _backward(layer, x[mine], dy[mine])
    assert_close(y, y_ref[mine], torch.float64, "y")
    assert_close(dx, dx_ref[mine], torch.float64, "dx")
    grads = _layer_shards({n: p.grad for n, p in full.named_parameters()}, rank, ws)
    for name, p in layer.named_parameters():
        assert_close(p.grad, grads[name], torch.float64, f"gradient of {name}")


def check_split_backward_of_a_parallel_layer(rank, ws):
    """Under fusible.split_backward a tensor- and sequence-parallel layer's deferred
    gradients (its column-parallel layers' dgrads reduce-scattered) are the unsplit
    backward's."""
    x = torch.randn(B, S, HIDDEN, generator=torch.Generator().manual_seed(3)).double()
    grads = []
    for split in (False, True):
        torch.manual_seed(0)
        layer = TransformerLayer(HIDDEN, FFN, HEADS, num_kv_heads=KV, bias=True,
                                 tensor_parallel=True, sequence_parallel=True,
                                 dtype=torch.float64)
        with fusible.split_backward(split):
            y = layer(x[_part(B, rank, ws)])
        y.backward(torch.ones_like(y))
        if split:
            assert fusible.pending_wgrad(), "nothing deferred: the check checks nothing"
            fusible.run_deferred_wgrad()
        grads.append({n: p.grad for n, p in layer.named_parameters()})
    for name, want in grads[0].items():
        assert_close(grads[1][name], want, torch.float64, f"split gradient of {name}")


@attrs.define
class _ScaleArgs:
    input: torch.Tensor
    weight: torch.Tensor


@attrs.define
class _ScaleBackwardArgs:
    grad_output: torch.Tensor
    input: torch.Tensor
    weight: torch.Tensor


class SequenceParallelScale(ops.BasicOperation):
    """``y = x * weight`` per feature, over tokens split across the group: a replicated
    parameter (its gradient summed over the group, ``grad_reduction``) whose backward
    splits (a plugin's, as no built-in op has one yet)."""

    param_names = ("weight",)
    fwd_args_type = _ScaleArgs
    bwd_args_type = _ScaleBackwardArgs
    saved_type = _ScaleBackwardArgs

    def __init__(self, features):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(features, dtype=torch.float64) + 0.5)
        self.parallel = parallel.sequence_parallel("SequenceParallelScale", True, None)

    def forward_args(self, input, params, extra_inputs, ctxs):
        return _ScaleArgs(input, params[0])

    @classmethod
    def forward_compute(cls, args, *, in_custom_op=False):
        return ForwardResult(args.input * args.weight)

    def save_for_backward(self, args, result, ctxs):
        ctxs[0].saved = _ScaleBackwardArgs(None, args.input, args.weight)

    def backward_args(self, grad_output, grad_extra_outputs, ctxs):
        saved = ctxs[0].saved
        return _ScaleBackwardArgs(grad_output, saved.input, saved.weight)

    @classmethod
    def backward_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(args.grad_output * args.weight,
                              ((args.grad_output * args.input).flatten(0, -2).sum(0),))

    @classmethod
    def dgrad_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(args.grad_output * args.weight, (None,)), args

    @classmethod
    def wgrad_compute(cls, args, *, in_custom_op=False):
        return BackwardResult(None, ((args.grad_output * args.input).flatten(0, -2).sum(0),))

    def deferred_params(self, recipe, needs):
        return (True,)

    def reference(self, x, extra_inputs, params):
        return x * params[0], ()


def check_split_backward_sums_deferred_wgrads_of_plugins(rank, ws):
    """A plugin's deferred wgrad of a replicated parameter over split tokens is summed
    over the group after it runs, as its unsplit backward's is."""
    x_full = torch.randn(B * ws, S, HIDDEN, generator=torch.Generator().manual_seed(3))
    x_full = x_full.double()
    grads = []
    for split in (False, True):
        torch.manual_seed(0)
        model = ops.Sequential(SequenceParallelScale(HIDDEN))
        with fusible.split_backward(split):
            y = model(x_full[_part(B * ws, rank, ws)])
        y.backward(torch.ones_like(y))
        if split:
            assert fusible.pending_wgrad(), "nothing deferred: the check checks nothing"
            fusible.run_deferred_wgrad()
        grads.append(model[0].weight.grad)
    want = x_full.flatten(0, -2).sum(0)  # every rank's tokens
    assert_close(grads[0], want, torch.float64, "unsplit")
    assert_close(grads[1], want, torch.float64, "split")
