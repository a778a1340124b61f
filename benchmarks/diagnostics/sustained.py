"""Does a step slow down when the GPU runs it for longer? The zoo's Llama-3-8B FFN block
(fusible FP8 eager, torchao tensorwise compiled, torch.compile bf16) timed by ``do_bench``
over 0.1, 1 and 3 s of back-to-back steps, with the SM clock and the power drawn sampled
every 50 ms meanwhile: a median that grows with the run while the clock falls is the
power limit, not the code.

    PYTHONPATH=.:benchmarks python3 benchmarks/diagnostics/sustained.py
"""

import subprocess

import triton.testing

from gpu_idle import warm_step


def sampled(fn) -> tuple:
    """``fn()``'s result and the (median SM MHz, median W) nvidia-smi saw meanwhile."""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    try:
        result = fn()
    finally:
        smi.terminate()
    samples = [tuple(float(v) for v in line.split(",")) for line in smi.communicate()[0].split("\n")
               if line.count(",") == 1]
    mhz, watts = (sorted(s[i] for s in samples) for i in (0, 1))
    return result, (mhz[len(mhz) // 2], watts[len(watts) // 2]) if samples else (0, 0)


def report(row: str) -> None:
    step = warm_step(row)  # the zoo's first config: Llama-3-8B FFN, 8192 tokens
    for rep in (100, 1000, 3000):
        ms, (mhz, watts) = sampled(lambda: triton.testing.do_bench(
            step, warmup=25, rep=rep, return_mode="median"))
        print(f"{row:22s} do_bench over {rep:5d} ms: median {ms:.3f} ms/step; "
              f"SM {mhz:.0f} MHz, {watts:.0f} W")


if __name__ == "__main__":
    for row in ("fusible_fp8_eager", "torchao_tensorwise", "torch_compile"):
        report(row)
