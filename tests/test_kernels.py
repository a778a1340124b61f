"""Triton kernels against their PyTorch fallbacks, run on CPU by Triton's interpreter."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent("""
    import torch
    from fusible.kernels.dact_dbias import dact_dbias_torch, dact_dbias_triton
    from fusible.testing import assert_close
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for kind in ("gelu", "gelu_tanh", "relu", "silu"):
            for shape in ((70, 200), (3, 5, 33)):
                dy = torch.randn(shape).to(dtype)
                saved = (3 * torch.randn(shape)).to(dtype)
                if kind == "relu":
                    saved = saved.relu()
                dact, dbias = dact_dbias_triton(kind, dy, saved, rows_per_program=64,
                                                block_m=16, block_n=64)
                ref_dact, ref_dbias = dact_dbias_torch(kind, dy.double(), saved.double())
                assert_close(dact, ref_dact, dtype, f"{kind} {dtype} dact")
                assert_close(dbias, ref_dbias, dtype, f"{kind} {dtype} dbias")
    print("ok")
""")


def test_dact_dbias_triton_matches_reference():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
