"""GPU: which PyTorch ops of the 1B decoder layer's FP8 step (``TransformerLayer``
under ``fusible.autocast()``, eager, 2 x 4096 tokens) launch the plain elementwise and
reduction kernels beside the GEMMs, casts and attention: the kernels by self CUDA time
with their input shapes, then every PyTorch call of one step whose result has at least a
hidden-sized tensor's elements, with its result's shape and dtype and the fusible lines
that made it (the profiler keeps no Python stacks on every PyTorch build: a
``TorchFunctionMode`` sees the calls instead, and leaves the Triton kernels' choice alone).

    python benchmarks/diagnostics/fp8_layer_ops.py
"""

import collections
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

import fusible
from fusible.layers import TransformerLayer
from fusible.runtime import executor

HIDDEN, FFN, HEADS, KV, BATCH, SEQ = 2048, 8192, 32, 8, 2, 4096
# calls that return a view (no kernel): left out of the census
VIEWS = {"expand", "reshape", "view", "t", "transpose", "detach", "__get__", "flatten",
         "unflatten", "chunk", "split", "narrow", "select", "unsqueeze", "squeeze", "permute",
         "view_as", "as_strided", "__getitem__", "movedim", "unbind", "requires_grad_"}


class CallCensus(TorchFunctionMode):
    """Counts the PyTorch calls whose tensor result has ``smallest`` elements or more, by
    function, result shape and dtype, and the innermost fusible frames that called them."""

    def __init__(self, smallest: int):
        super().__init__()
        self.smallest, self.calls = smallest, collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", str(func))
        if (isinstance(out, torch.Tensor) and out.numel() >= self.smallest
                and name not in VIEWS):
            frames = [f for f in traceback.extract_stack()[:-1] if "/fusible/" in f.filename]
            where = " < ".join(f"{f.filename.split('/fusible/')[-1]}:{f.lineno} {f.name}"
                               for f in frames[::-1][:7])
            self.calls[(name, tuple(out.shape), str(out.dtype).replace("torch.", ""),
                        where)] += 1
        return out


def main() -> None:
    torch.manual_seed(0)
    layer = TransformerLayer(HIDDEN, FFN, HEADS, num_kv_heads=KV, rotary_base=500000.0,
                             device="cuda", dtype=torch.bfloat16)
    x = torch.randn(BATCH, SEQ, HIDDEN, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        with fusible.autocast():
            y = layer(x)
        y.backward(dy)
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages(group_by_input_shape=True)
    print(table.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=40,
                      max_shapes_column_width=90))
    print("The PyTorch ops of that step with a hidden-sized operand, by their parent ops:")
    parents = collections.Counter()
    for event in prof.events():
        shapes = [list(s) for s in (event.input_shapes or []) if s]
        if event.name.startswith("aten::") and any(
                s[0] >= BATCH * SEQ or s[:2] == [BATCH, SEQ] for s in shapes):
            chain, up = [], event.cpu_parent
            while up is not None and len(chain) < 5:
                chain.append(up.name)
                up = up.cpu_parent
            parents[(event.name, str(shapes)[:80], " < ".join(chain))] += 1
    for (name, shapes, chain), count in parents.items():
        print(f"{count:3d} {name:28s} {shapes:82s} {chain}")
    census = CallCensus(BATCH * SEQ * HIDDEN // 4)
    # the autograd engine runs the backward on its own thread, outside the mode: enter it
    # there too
    run_backward = executor.run_backward

    def census_backward(*args, **kwargs):
        with census:
            return run_backward(*args, **kwargs)

    executor.run_backward = census_backward
    try:
        with census:
            step()
    finally:
        executor.run_backward = run_backward
    print("PyTorch calls of one step with large results (count, function, shape, dtype, "
          "where):")
    for (name, shape, dtype, where), count in sorted(census.calls.items(),
                                                     key=lambda kv: kv[0][3]):
        print(f"{count:3d} {name:24s} {str(shape):22s} {dtype:14s} {where}")


if __name__ == "__main__":
    main()
