"""Delayed scaling under tensor parallelism (run by tests/test_parallel.py in spawned
processes): FP8 gathers with the group's histories, and sequence-parallel layers whose
amaxes are reduced over the group, step after step, against one process."""

import copy

import torch

import fusible
from fusible import ops
from fusible.testing import snr_db
from parallel_layers import DEVICE, _part, _uneven, linear_step


def _gathered_states(state: torch.Tensor, tp) -> list:
    from fusible.functional.parallel import all_gather
    return list(all_gather(state.view(1, -1), tp).unbind(0))


def check_fp8_gather_delayed(rank, ws):
    """Each rank casts its tokens by the state's scale and the FP8 bytes are gathered; the
    amax joins the history after a maximum over the group: three steps give the bits of
    gathering in high precision and then casting with one state, and every rank's state
    is that state."""
    from fusible.functional.linear_parallel import gather_fp8
    from fusible.functional.parallel import all_gather
    from fusible.quantization import to_format
    tp = ops.BasicLinear(32, 32, tensor_parallel_mode="column", sequence_parallel=True).parallel
    fmt = fusible.DelayedScaling(amax_history_len=2).input_format(columnwise=True)
    ours, ref = (torch.zeros(fmt.scaling.state_size, device=DEVICE[0]) for _ in range(2))
    g = torch.Generator().manual_seed(14)
    for step in range(3):
        parts = [torch.randn(32, 64, generator=g) * 4.0 ** (r - step) for r in range(ws)]
        x = parts[rank].to(DEVICE[0], torch.bfloat16)
        got = gather_fp8(x, tp, fmt.bound(ours))
        want = to_format(all_gather(x, tp), fmt.bound(ref))
        for name in ("_data", "_scale_inv", "_transpose"):
            a, b = (t.contiguous() for t in (getattr(got, name), getattr(want, name)))
            if a.element_size() == 1:
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            if not torch.equal(a, b):
                raise AssertionError(f"delayed FP8 all-gather, step {step}: {name} differs from "
                                     f"gather-then-quantize")
        if not torch.equal(ours, ref):
            raise AssertionError(f"delayed FP8 all-gather, step {step}: state {ours} != {ref}")
        if not all(torch.equal(s, ours) for s in _gathered_states(ours, tp)):
            raise AssertionError(f"delayed FP8 all-gather, step {step}: the ranks' states differ")


def check_linear_delayed(rank, ws, mode):
    """A sequence-parallel linear layer under delayed scaling whose amaxes are reduced over
    the tensor-parallel group (``reduce_amax``) against the full layer in one process, three
    steps: every rank's state of every role is the full layer's, so every operand is cast
    alike and each result is the full layer's slice, bit for bit, but the one its GEMM
    leaves as a partial sum (column: dx, row: y; by SNR); compiled bitwise eager."""
    layer = ops.Linear(256, 256, bias=False, tensor_parallel_mode=mode, sequence_parallel=True,
                       device=DEVICE[0], dtype=torch.bfloat16)
    recipe = fusible.DelayedScaling(amax_history_len=4, reduce_amax=True,
                                    amax_reduction_group=layer._ops[0].tensor_parallel_group)
    full = ops.Linear(256, 256, bias=False, device=DEVICE[0], dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    tokens = 128 * ws
    w = torch.randn(256, 256, generator=g, dtype=torch.float64) / 16
    tok, feat = _part(tokens, rank, ws), _part(256, rank, ws)
    shard = (feat, slice(None)) if mode == "column" else (slice(None), feat)
    with torch.no_grad():
        full.weight.copy_(w)
        layer.weight.copy_(w[shard])
    twin = copy.deepcopy(layer)
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    for step in range(3):
        x = torch.randn(tokens, 256, generator=g, dtype=torch.float64) * _uneven(
            torch.ones(tokens, 1, dtype=torch.float64)) * 2.0 ** step
        dy = torch.randn(tokens, 256, generator=g, dtype=torch.float64) * 2.0 ** -step
        want = linear_step(full, x, dy, recipe)
        x_in = x[tok] if mode == "column" else x[:, feat]
        dy_in = dy[:, feat] if mode == "column" else dy[tok]
        eager = linear_step(layer, x_in, dy_in, recipe)
        got_compiled = linear_step(compiled, x_in, dy_in, recipe, twin)
        want = {"y": want["y"][:, feat] if mode == "column" else want["y"][tok],
                "dx": want["dx"][tok] if mode == "column" else want["dx"][:, feat],
                "dw": want["dw"][shard]}
        _compare(eager, want, got_compiled, "dx" if mode == "column" else "y", mode, step)
    for (name, a), b in zip(layer.named_buffers(), full.buffers()):
        if not torch.equal(a, b):
            raise AssertionError(f"delayed {mode}: {name} is not the full layer's")


def _compare(eager, want, compiled, inexact, mode, step):
    for key in want:
        if key != inexact and not torch.equal(eager[key], want[key]):
            raise AssertionError(f"delayed {mode} step {step} {key}: differs from one process")
        if key == inexact and snr_db(eager[key], want[key]) < 45:
            raise AssertionError(f"delayed {mode} step {step} {key}: "
                                 f"{snr_db(eager[key], want[key])} dB against one process")
        if not torch.equal(eager[key], compiled[key]):
            raise AssertionError(f"delayed {mode} step {step} {key}: compiled differs")
