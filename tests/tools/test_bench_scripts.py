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


def test_rewards_before_row_loads_the_unsandboxed_reward_of_its_revision():
    """The `before` row's reward lives at megaloop/rl/sandbox.py in --before-rev (before the move to
    megaloop/post/rl); the script looked at the new path, silently dropped the row and report.py then
    failed on the rewards row. It loads the old module again and scores right and wrong solutions."""
    rev_there = subprocess.run(["git", "cat-file", "-e", "65b0666500831c2c639c2d25246bbec2180e10e8"], cwd=ROOT,
                               capture_output=True).returncode == 0
    if not rev_there:
        pytest.skip("the benchmark's --before-rev is not in this clone's history (shallow clone)")
    sys.path.insert(0, str(BENCH))
    try:
        import bench_rewards
    finally:
        sys.path.remove(str(BENCH))
    from megaloop.post.rl.sandbox import DATA_DIR

    old = bench_rewards._old_module(bench_rewards.BEFORE_REV)
    assert old is not None
    task = old.CodeTask(DATA_DIR / "mbpp_tiny.jsonl")
    pairs, want = bench_rewards._pairs(task, 1)
    assert [task.reward(e, c) for e, c in pairs[:4]] == want[:4] == [1.0, 0.0, 1.0, 0.0]
    assert bench_rewards._old_module("0" * 40) is None
