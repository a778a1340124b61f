"""One-off GPU diagnostics: per-prefix accuracy of the MLP block and eager overhead timings."""

import time

import torch

from fusible import ops
from fusible.testing import exact_parameters_, exact_tensor, reference_forward


def prefix_errors(dtype):
    torch.manual_seed(0)
    full = [ops.MakeExtraOutput(), ops.LayerNorm(64), ops.Linear(64, 256),
            ops.GELU(approximate="tanh"), ops.Linear(256, 64), ops.AddExtraInput()]
    x = exact_tensor((4, 32, 64), dtype, device="cuda")
    r = exact_tensor((4, 32, 64), dtype, device="cuda")
    for n in range(1, len(full) + 1):
        model = exact_parameters_(ops.Sequential(*full[:n]).to("cuda", dtype))
        extras = (r,) if n == len(full) else ()
        with torch.no_grad():
            out = model(x, *extras)
            ref, _ = reference_forward(model, x.double(), *(e.double() for e in extras))
        out = out[0] if isinstance(out, tuple) else out
        ref = ref[0] if isinstance(ref, tuple) else ref
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        names = [s.name for s in model.plan(x, *extras).forward]
        print(f"{dtype} prefix {n}: rel max err {err:.2e} stages {names}")


def addmm_checks(dtype):
    a = exact_tensor((128, 64), dtype, device="cuda")
    w = exact_tensor((32, 64), dtype, device="cuda")
    c = exact_tensor((128, 32), dtype, device="cuda")
    b = exact_tensor((32,), dtype, device="cuda")
    ref = (a.double() @ w.double().T + c.double())
    y = torch.addmm(c, a, w.t())
    print(dtype, "addmm(C 2-D) err", (y.double() - ref).abs().max().item())
    y.add_(b)
    print(dtype, "then add_(bias) err", (y.double() - ref - b.double()).abs().max().item())
    y3 = torch.addmm(c, a.view(4, 32, 64).reshape(-1, 64), w.t())
    print(dtype, "addmm via reshape err", (y3.double() - ref).abs().max().item())


def overheads():
    torch.manual_seed(0)
    model = ops.Sequential(ops.Linear(1024, 4096), ops.GELU(approximate="tanh"),
                           ops.Linear(4096, 1024)).to("cuda", torch.bfloat16)
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    from fusible.functional.activations import dact_dbias_torch
    from fusible.kernels import dact_dbias as k
    dy = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    s = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)

    def wall(fn, n=200):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        cpu = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
        return f"{cpu:.1f} us submit, {(time.perf_counter() - t) / n * 1e6:.1f} us total"

    print("triton dact_dbias", wall(lambda: k.dact_dbias_triton("gelu_tanh", dy, s)))
    print("torch dact_dbias", wall(lambda: dact_dbias_torch("gelu_tanh", dy, s)))
    print("forward", wall(lambda: model(x)))
    print("fwd+bwd", wall(lambda: model(x).sum().backward()))
    ref = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(approximate="tanh"),
                              torch.nn.Linear(4096, 1024)).to("cuda", torch.bfloat16)
    print("torch forward", wall(lambda: ref(x)))
    print("torch fwd+bwd", wall(lambda: ref(x).sum().backward()))


for dt in (torch.float32, torch.bfloat16, torch.float16):
    prefix_errors(dt)
    addmm_checks(dt)
overheads()
