"""The docs: every ```python block of every page runs, in order, one namespace per page;
the site builds strictly (broken links and docstring errors fail).

A page may prepare its blocks with a hidden ``<!-- docs-test setup ... -->`` comment (the
code in it runs before the next block), and mark a block that cannot run in one process
with ``<!-- docs-test skip: why -->`` right before it (several ranks), naming the test that
runs its code. A block that needs a GPU is marked ``<!-- docs-test gpu: why -->`` (why, and
the CPU test that runs its code) and prepared by ``<!-- docs-test gpu-setup ... -->``: it
runs where CUDA is (scripts/gpu_check.sh) and is skipped elsewhere. A block of several
ranks is marked ``<!-- docs-test ranks N`` followed by its hidden set-up and ``-->``: it runs
on N gloo processes (the harness's process group stands in for the block's own
``init_process_group``), each with a namespace of its own holding ``rank``,
``world_size``, ``device_type`` ("cpu") and ``tmp_dir`` (one directory for all the ranks);
``ranks N torch>=X.Y (why)`` runs it only from that PyTorch version. A page that renders a diagram needs graphviz's
``dot``.
"""

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

from fusible.testing.distributed import run_distributed

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md"))
TOKEN = re.compile(r"<!-- docs-test setup\n(?P<setup>.*?)-->|<!-- docs-test skip: (?P<skip>.+?) -->"
                   r"|<!-- docs-test gpu-setup\n(?P<gpu_setup>.*?)-->"
                   r"|<!-- docs-test gpu: (?P<gpu>.+?) -->|<!-- docs-test ranks (?P<ranks>\d+[^\n]*\n.*?)-->"
                   r"|```python\n(?P<code>.*?)```", re.S)
GPU = torch.cuda.is_available()


def blocks(page: pathlib.Path) -> list:
    """``(kind, text)`` in page order: "setup", "skip" (its reason, for the next block),
    "code"."""
    return [(m.lastgroup, m.group(m.lastgroup)) for m in TOKEN.finditer(page.read_text())]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_code_block_runs(page, tmp_path, monkeypatch, fresh_dynamo, plugins):
    """What a page registers (its example fusion, its example recipe) is gone after it
    (``plugins``): later tests see only the built-ins and their own."""
    if ".render(" in page.read_text() and shutil.which("dot") is None:
        pytest.skip("the page renders a diagram: needs graphviz's dot")
    monkeypatch.chdir(tmp_path)  # what the blocks write (diagrams) lands here
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    skip, ranks = None, None
    for k, (kind, text) in enumerate(blocks(page)):
        if kind == "skip" or kind == "gpu" and not GPU:
            skip = text
            continue
        if kind == "gpu" or kind == "gpu_setup" and not GPU:
            continue
        if kind == "ranks":
            ranks = text
            continue
        if kind == "code" and ranks is not None:
            first, setup = ranks.split("\n", 1)
            ranks = None
            count, _, needs = first.partition(" torch>=")
            if needs and _torch_version() < tuple(map(int, needs.split()[0].split("."))):
                continue  # the reason follows the version in the marker
            with tempfile.TemporaryDirectory() as tmp_dir:
                run_distributed(run_block_on_a_rank, int(count), setup, text, tmp_dir,
                                f"{page.name} block {k}", timeout=300)
            continue
        if kind == "code" and skip is not None:
            assert skip.strip(), f"{page.name}: a skip needs its reason"
            skip = None
            continue
        try:
            exec(compile(text, f"{page.name} block {k}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"{page.name}, block {k} ({kind}) raised {error!r}:\n"
                                 f"{text}") from error


def _torch_version() -> tuple:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def run_block_on_a_rank(rank: int, world_size: int, setup: str, code: str, tmp_dir: str,
                        where: str):
    """One rank of a block of several: its set-up, then the block, in a namespace of its
    own; the block's ``init_process_group`` is the harness's (already initialised)."""
    namespace = {"__name__": "docs_rank", "rank": rank, "world_size": world_size,
                 "device_type": "cpu", "tmp_dir": tmp_dir}
    real = dist.init_process_group
    dist.init_process_group = lambda *args, **kwargs: None
    try:
        exec(compile(setup, f"{where} (set-up)", "exec"), namespace)
        exec(compile(code, where, "exec"), namespace)
    finally:
        dist.init_process_group = real


def test_skips_name_the_test_that_runs_them():
    """A block that cannot run here (several ranks, a GPU) names the test that runs its
    code; most blocks run."""
    skips = [(p.name, text) for p in PAGES for kind, text in blocks(p)
             if kind in ("skip", "gpu")]
    assert all("tests/" in why for _, why in skips), skips
    code = sum(kind == "code" for p in PAGES for kind, _ in blocks(p))
    assert len(skips) * 2 < code, (len(skips), code)


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs not installed")
def test_the_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                         env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "api" / "index.html").exists()
