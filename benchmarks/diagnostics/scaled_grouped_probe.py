"""What ``torch._scaled_grouped_mm`` takes on this GPU and PyTorch: operand dtypes (E4M3,
E5M2), scale shapes of the 2d-3d (forward, dgrad) and 2d-2d (wgrad) forms, empty groups,
float32 output, fast accumulation; each variant against a float64 loop over groups.

    python benchmarks/diagnostics/scaled_grouped_probe.py
"""

import torch

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
dev = "cuda"


def q(t, dtype):
    """(fp8 data, per-tensor scale_inv) of t."""
    amax = t.abs().max().float()
    scale = torch.finfo(dtype).max / amax
    return (t.float() * scale).clamp(-torch.finfo(dtype).max,
                                     torch.finfo(dtype).max).to(dtype), 1 / scale


def report(name, fn):
    try:
        got, want = fn()
        err = ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
        print(f"{name}: OK rel err {err:.2e} shape {tuple(got.shape)} "
              f"strides {got.stride()} dtype {got.dtype}", flush=True)
    except Exception as e:
        print(f"{name}: FAIL {type(e).__name__}: {str(e)[:300]}", flush=True)


def forward_2d3d(a_dtype=E4, b_dtype=E4, splits=(32, 0, 48, 16), out_dtype=torch.bfloat16,
                 fast=True, k=64, n=128, weight_layout="stack"):
    def run():
        g, m = len(splits), sum(splits)
        x = torch.randn(m, k, device=dev)
        w = torch.randn(g, n, k, device=dev)
        xa, sx = q(x, a_dtype)
        wq, sw = q(w, b_dtype)
        if weight_layout == "stack":  # (g, n, k) row-major -> (g, k, n) column-major view
            b = wq.transpose(-2, -1)
        else:  # the transpose of one (g*n, k) cast: element (e, k, n) at k*g*n + e*n + n
            b = wq.reshape(g * n, k).t().contiguous().view(k, g, n).permute(1, 0, 2)
        offs = torch.cumsum(torch.tensor(splits, device=dev), 0, dtype=torch.int32)
        y = torch._scaled_grouped_mm(xa, b, sx.expand(m).contiguous(),
                                     sw.expand(g, n).contiguous(), offs=offs,
                                     out_dtype=out_dtype, use_fast_accum=fast)
        xd, wd = xa.double() * sx.double(), wq.double() * sw.double()
        want, start = torch.zeros(m, n, device=dev, dtype=torch.float64), 0
        for e, s in enumerate(splits):
            want[start:start + s] = xd[start:start + s] @ wd[e].t()
            start += s
        return y, want
    return run


def wgrad_2d2d(a_dtype=E5, b_dtype=E4, splits=(32, 0, 48, 16), scale_shape="flat",
               out_dtype=torch.bfloat16, n=128, k=64):
    def run():
        g, m = len(splits), sum(splits)
        dy = torch.randn(m, n, device=dev)
        x = torch.randn(m, k, device=dev)
        dyq, sdy = q(dy, a_dtype)
        xq, sx = q(x, b_dtype)
        a = dyq.t().contiguous()          # (n, m) row-major
        b = xq.t().contiguous().t()       # (m, k) column-major
        offs = torch.cumsum(torch.tensor(splits, device=dev), 0, dtype=torch.int32)
        if scale_shape == "flat":
            sa, sb = sdy.expand(g * n).contiguous(), sx.expand(g * k).contiguous()
        else:
            sa, sb = sdy.expand(g, n).contiguous(), sx.expand(g, k).contiguous()
        dw = torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=out_dtype)
        dyd, xd = dyq.double() * sdy.double(), xq.double() * sx.double()
        want, start = torch.zeros(g, n, k, device=dev, dtype=torch.float64), 0
        for e, s in enumerate(splits):
            want[e] = dyd[start:start + s].t() @ xd[start:start + s]
            start += s
        if dw.shape == want.shape:
            zeros = [e for e, s in enumerate(splits) if s == 0]
            print(f"   empty groups' wgrad all zero: "
                  f"{all(bool((dw[e] == 0).all()) for e in zeros)}")
        return dw, want
    return run


def bf16_grouped_empty():
    splits = (32, 0, 48, 16)
    dy = torch.randn(96, 128, device=dev, dtype=torch.bfloat16)
    x = torch.randn(96, 64, device=dev, dtype=torch.bfloat16)
    offs = torch.cumsum(torch.tensor(splits, device=dev), 0, dtype=torch.int32)
    dw = torch._grouped_mm(dy.t(), x, offs=offs)
    print("bf16 _grouped_mm empty group's wgrad all zero:", bool((dw[1] == 0).all()))


def main():
    print(torch.__version__, torch.cuda.get_device_name())
    report("fwd e4m3 x e4m3", forward_2d3d())
    report("fwd e4m3 x e4m3 no fast accum", forward_2d3d(fast=False))
    report("fwd e4m3 x e4m3 float32 out", forward_2d3d(out_dtype=torch.float32))
    report("dgrad e5m2 x e4m3", forward_2d3d(a_dtype=E5))
    report("fwd e4m3 x e4m3, weight from a 2-D transposed cast",
           forward_2d3d(weight_layout="flat"))
    report("fwd, empty first and last group", forward_2d3d(splits=(0, 64, 32, 0)))
    report("fwd, 16-row groups of odd count", forward_2d3d(splits=(16, 48, 0, 32)))
    report("fwd, group sizes not multiple of 16", forward_2d3d(splits=(5, 27, 0, 64)))
    report("wgrad e5m2 x e4m3 flat scales", wgrad_2d2d())
    report("wgrad e4m3 x e4m3 flat scales", wgrad_2d2d(a_dtype=E4))
    report("wgrad e4m3 x e4m3 (g, n) scales", wgrad_2d2d(a_dtype=E4, scale_shape="2d"))
    report("wgrad e4m3 float32 out", wgrad_2d2d(a_dtype=E4, out_dtype=torch.float32))
    report("wgrad e4m3 sizes not multiple of 16", wgrad_2d2d(a_dtype=E4, splits=(5, 27, 0, 64)))
    bf16_grouped_empty()


if __name__ == "__main__":
    main()
