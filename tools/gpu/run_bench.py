"""Run tools/bench/bench_loop_overhead.py unchanged, but write its result JSON into a given folder.

    python tools/gpu/run_bench.py OUT_DIR [bench arguments...]

The benchmark writes ``tools/bench/results/loop_overhead[_gpu].json`` through
``common.write_result``; tools/gpu_check.sh must not overwrite the committed CPU result during a
CPU smoke run, and on the GPU machine only ``$OUT`` comes back. This points ``common.RESULTS`` at
OUT_DIR and then runs the benchmark as ``__main__`` (same code, same arguments).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench"


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: run_bench.py OUT_DIR [bench arguments...]")
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(BENCH))
    import common  # tools/bench/common.py: the benchmark's `from common import ...` gets this module

    common.RESULTS = out
    script = BENCH / "bench_loop_overhead.py"
    sys.argv = [str(script), *sys.argv[2:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
