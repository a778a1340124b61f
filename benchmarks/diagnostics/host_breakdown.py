"""Where the host time of a host-bound step goes, for a zoo config (by default the
Llama-3-8B FFN at 2048 tokens, where fusible's FP8 steps wait on the host):

- per row, the host time to launch the forward and the backward (no profiler; the GPU
  runs behind, so this is launch cost alone), median of 20 steps;
- fusible's own functions by cumulative host time over 20 FP8 eager steps
  (``gpu_idle.host_profile``, cProfile: its overhead inflates every figure, compare them
  with each other);
- one Triton launch through ``JITFunction`` against through the compiled kernel it
  returns (the binding and specialisation the JIT redoes on every call).

    PYTHONPATH=.:benchmarks python3 benchmarks/diagnostics/host_breakdown.py [CONFIG_INDEX]
"""

import statistics
import sys
import time

import torch

from fusible.kernels import fp8_cast
from gpu_idle import host_profile
from gpu_mlp import prepare
from host_costs import per_call_us
from zoo import CONFIGS, build_row

ROWS = ("torch_eager", "torch_compile", "torchao_tensorwise", "fusible_bf16_eager",
        "fusible_fp8_eager", "fusible_fp8_compile")


def launch_split(row: str, config: tuple, steps: int = 20):
    """``(forward ms, backward ms, step)``: median host times to launch each half."""
    name, hidden, ffn, tokens = config
    model, mode, context = build_row(row, name, hidden, ffn)
    run = prepare(model, mode)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    params = list(model.parameters())

    def halves():
        torch.cuda.synchronize()
        start = time.perf_counter()
        with context():
            y = run(x)
        mid = time.perf_counter()
        y.backward(dy)
        end = time.perf_counter()
        x.grad = None
        for p in params:
            p.grad = None
        return (mid - start) * 1e3, (end - mid) * 1e3

    for _ in range(5):
        halves()
    times = [halves() for _ in range(steps)]
    return (statistics.median(t[0] for t in times), statistics.median(t[1] for t in times),
            halves)


def triton_launch_paths() -> None:
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    amax = torch.ones((), device="cuda")
    data, transpose, scale_inv, has_t = fp8_cast.fp8_buffers(x, torch.float8_e4m3fn, True)
    args = (x, amax, data, transpose, scale_inv, 256, 512, 448.0)
    constants = dict(HAS_T=has_t, HAS_DATA=True, BLOCK_M=64, BLOCK_N=128)

    def jit_launch():
        return fp8_cast._cast_kernel[(16,)](*args, **constants)

    kernel = jit_launch()
    print(f"   JITFunction launch {per_call_us(jit_launch):8.1f} us")
    try:
        runner = kernel[(16, 1, 1)]
        every = args + tuple(constants.values())
        print(f"   compiled launch   {per_call_us(lambda: runner(*every)):8.1f} us")
        stream = torch.cuda.current_stream().cuda_stream
        given = per_call_us(lambda: runner(*every, stream=stream))
        print(f"   compiled, stream given {given:8.1f} us")
        made = per_call_us(lambda: kernel[(16, 1, 1)](*every, stream=stream))
        print(f"   compiled, runner made per call {made:8.1f} us")
    except Exception as error:  # the API moved between Triton versions
        print("   compiled launch failed:", repr(error)[:200])


def main(config: tuple) -> None:
    print(f"== {config}: host ms to launch forward / backward (median of 20)")
    fp8_step = None
    for row in ROWS:
        torch._dynamo.reset()
        forward, backward, step = launch_split(row, config)
        print(f"   {row:22s} {forward:7.3f} {backward:7.3f}  total {forward + backward:7.3f}")
        if row == "fusible_fp8_eager":
            fp8_step = step
    print("== fusible FP8 eager, cumulative host time of fusible's functions, 20 steps")
    print(host_profile(fp8_step, top=45, sort="cumtime",
                       restrict=("fusible|triton|torch/_tensor|autograd",)))
    print("== one cast-kernel launch")
    triton_launch_paths()


if __name__ == "__main__":
    import host_costs
    main(CONFIGS[int(sys.argv[1]) if len(sys.argv) > 1 else 1])
    print("== host costs of the pieces")
    host_costs.main()
