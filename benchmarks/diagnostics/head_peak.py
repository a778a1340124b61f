"""GPU: where the LM head's memory peak comes from (8192 tokens, hidden 4096, vocab
128256, ``ops.LinearCrossEntropy`` eager, one training step): the CUDA caching
allocator's history of the step replayed to its highest total, and the blocks alive
there with the Python line that allocated each. For the head's peak against Liger's
(docs/benchmarks.md).

    python benchmarks/diagnostics/head_peak.py [chunk tokens]
"""

import sys

import torch

from allocator_peak import blocks_at_peak
from fusible import ops

HIDDEN, VOCAB, TOKENS = 4096, 128256, 8192


def main() -> None:
    chunk = int(sys.argv[1]) if len(sys.argv) > 1 else None
    torch.manual_seed(0)
    head = ops.Sequential(ops.LinearCrossEntropy(HIDDEN, VOCAB, chunk_size=chunk))
    head = head.to("cuda", torch.bfloat16)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, VOCAB, (TOKENS,), device="cuda")

    def step():
        head(x, labels).backward()
        x.grad = None
        for p in head.parameters():
            p.grad = None
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    peak, blocks = blocks_at_peak(step)
    print(f"chunk {chunk}: before the step {base / 2**30:.2f} GiB, peak "
          f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB; the step's blocks alive "
          f"at its peak, {peak / 2**30:.2f} GiB:")
    for size, where in blocks[:12]:
        print(f"  {size / 2**20:9.1f} MiB  {where}")


if __name__ == "__main__":
    main()
