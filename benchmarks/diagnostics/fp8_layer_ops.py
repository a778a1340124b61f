"""GPU: which PyTorch ops of the 1B decoder layer's FP8 step (``TransformerLayer``
under ``fusible.autocast()``, eager, 2 x 4096 tokens) launch the plain elementwise and
reduction kernels beside the GEMMs, casts and attention: the ops by self CUDA time with
their input shapes and the Python lines that called them (the FP8 layer's kernels add
up to more than torchao's compiled step: docs/benchmarks.md, sixth runs).

    python benchmarks/diagnostics/fp8_layer_ops.py
"""

import torch
from torch.profiler import ProfilerActivity, profile

import fusible
from fusible.layers import TransformerLayer

HIDDEN, FFN, HEADS, KV, BATCH, SEQ = 2048, 8192, 32, 8, 2, 4096


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
                 record_shapes=True, with_stack=True) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages(group_by_input_shape=True)
    print(table.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=40,
                      max_shapes_column_width=70))
    stacks = prof.key_averages(group_by_stack_n=6)
    print(stacks.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=30,
                       max_src_column_width=200))


if __name__ == "__main__":
    main()
