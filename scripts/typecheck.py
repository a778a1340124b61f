"""Type-check fusible/ with mypy (pyproject.toml's [tool.mypy]) against the baseline.

The public API is annotated; the errors mypy still finds in older bodies are listed in
scripts/mypy_baseline.txt (file, code and message, without line numbers). A run fails on
any error not in the baseline, and says which baseline entries are gone (then run with
--update to shrink it).

    python scripts/typecheck.py [--update]
"""

import collections
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASELINE = ROOT / "scripts" / "mypy_baseline.txt"
LINE = re.compile(r"^(?P<file>[^:]+):\d+: error: (?P<message>.*)$")


def errors() -> collections.Counter:
    run = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                         text=True)
    if run.returncode not in (0, 1):
        sys.exit(f"mypy failed to run:\n{run.stdout}{run.stderr}")
    found = collections.Counter()
    for line in run.stdout.splitlines():
        m = LINE.match(line)
        if m:
            found[f"{m['file']}: {m['message']}"] += 1
    return found


def main() -> int:
    found = errors()
    if "--update" in sys.argv:
        BASELINE.write_text("".join(f"{e}\n" for e in sorted(found.elements())))
        print(f"baseline: {sum(found.values())} errors")
        return 0
    baseline = collections.Counter(BASELINE.read_text().splitlines())
    new, gone = found - baseline, baseline - found
    for e in sorted(new.elements()):
        print(f"new: {e}")
    if gone:
        print(f"{sum(gone.values())} baseline errors are gone: run with --update")
    print(f"mypy: {sum(found.values())} errors, {sum(new.values())} new "
          f"(baseline {sum(baseline.values())})")
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
