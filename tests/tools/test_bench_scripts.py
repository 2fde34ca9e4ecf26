"""Benchmark scripts refuse bad options before any timing (tools/bench/)."""

import subprocess
import sys

import pytest

from tests.conftest import ROOT

BENCH = ROOT / "tools" / "bench"


def _run(script: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *argv], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


@pytest.mark.parametrize("argv, message", [
    ((), "pass --huginn PATH and/or --parcae PATH"),
    (("--huginn", "/nonexistent/recurrent-pretraining"), "--huginn: /nonexistent/recurrent-pretraining has no "
                                                         "recpre/model_dynamic.py"),
    (("--parcae", "/nonexistent", "--depth", "3", "--bptt-window", "4"), "--bptt-window: must be in [1, --depth 3]"),
])
def test_vs_refs_names_the_missing_or_wrong_reference(argv, message):
    proc = _run("bench_vs_refs.py", *argv)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_tbptt_memory_refuses_a_summary_depth_it_would_not_measure():
    """--depths 4,8 used to run every case and then die with KeyError (32, 'b=4'), writing nothing."""
    proc = _run("bench_tbptt_memory.py", "--depths", "4,8")
    assert proc.returncode == 2 and "--compare 8,32: two different depths of --depths 4,8" in proc.stderr, proc.stderr
