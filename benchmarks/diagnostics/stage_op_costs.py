"""Host cost of each stage custom op of a small MLP on the CPU: the op called through the
dispatcher (what a compiled graph does) against its compute method called directly, and
what building the args record costs. The difference is the custom-op boundary.

    .venv/bin/python benchmarks/diagnostics/stage_op_costs.py
"""

import time

import torch

from fusible import ops
from fusible.runtime import custom_ops
from fusible.testing import recorded_stage_calls


def per_call_us(fn, calls: int = 20000) -> float:
    for _ in range(500):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    torch.set_num_threads(1)
    model = ops.Sequential(ops.Linear(64, 256), ops.GELU(approximate="tanh"), ops.Linear(256, 64))
    calls = recorded_stage_calls(model, torch.randn(16, 64, requires_grad=True))
    classes = {op.name: cls for (cls, _), op in custom_ops._OPS.items()}
    print(f"{'stage op':<42} {'args':>4} {'op call':>9} {'compute':>9} {'build':>7}  (us)")
    for name, (overload, flat) in calls.items():
        op = custom_ops.stage_op_named(name.split(".")[1])
        build = op.prepared(flat[-1])[0]
        direction = "forward" if op.name.endswith("_fwd") else "backward"
        compute = getattr(classes[op.name], f"{direction}_compute")
        args = build(flat)
        print(f"{op.name:<42} {len(flat):>4} {per_call_us(lambda: overload(*flat)):9.1f} "
              f"{per_call_us(lambda: compute(args, in_custom_op=True)):9.1f} "
              f"{per_call_us(lambda: build(flat)):7.1f}")


if __name__ == "__main__":
    main()
