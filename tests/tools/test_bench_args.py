"""Benchmark scripts refuse bad options with one line naming the option and exit status 2, before
anything is built or timed (tools/bench/bench_*.py): they used to die with a traceback (exit 1), e.g.
``--reps 0`` -> ``StatisticsError: no median for empty data``, ``--exits bogus:1`` -> ``ValueError``."""

import argparse
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

BENCH = ROOT / "tools" / "bench"
# {tmp}: the test's tmp_path, an existing directory that is no checkpoint (nor a reference checkout,
# but for its marker file), so the scripts of before got past their path checks and crashed later; the
# options below are now refused while they are parsed, before the path is looked at
ADAPTIVE = ("--checkpoint", "{tmp}", "--reps", "1", "--seqs", "1", "--prompts", "1", "--new", "2",
            "--seq-len", "16")
DECODE = ("--hidden", "64", "--heads", "4", "--prompt", "8", "--new", "2", "--batch", "1", "--reps", "1")


def _run(tmp_path, script: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MEGALOOP_BENCH_RESULTS": str(tmp_path / "results"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(BENCH / script), *argv], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)


def _refused(proc: subprocess.CompletedProcess, script: str, message: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}: error: ") and message in last, proc.stderr[-3000:]


@pytest.mark.parametrize("script, argv, message", [
    # the audit's reproductions
    ("bench_adaptive_depth.py", (*ADAPTIVE, "--fixed", "0"), "argument --fixed: must be comma-separated integers >= 2"),
    ("bench_adaptive_depth.py", (*ADAPTIVE, "--fixed", "2", "--exits", "kl:1e-3", "--reps", "0"),
     "argument --reps: must be an integer >= 1, got '0'"),
    ("bench_adaptive_depth.py", (*ADAPTIVE, "--exits", "bogus:1"), "argument --exits: 'bogus:1': unknown criterion"),
    ("bench_adaptive_depth.py", (*ADAPTIVE, "--exits", ""), "argument --exits: '': expected NAME:VALUE"),
    ("bench_cpu_compat.py", ("--reps", "0", "--batch", "1", "--depth", "1"), "argument --reps: must be an integer >= 1"),
    ("bench_decode.py", (*DECODE, "--depths", "0"), "argument --depths: must be comma-separated integers >= 1"),
    ("bench_loop_overhead.py", ("--hidden", "64", "--heads", "3", "--seq", "16", "--batch", "1", "--vocab", "256",
                                "--reps", "1"), "--hidden 64: not divisible by --heads 3"),
    # more of the same across the scripts
    ("bench_adaptive_depth.py", (*ADAPTIVE, "--exits", "kl:1e-3,argmax:1"), "argument --exits: 'argmax:1': argmax needs"),
    ("bench_adaptive_depth.py", (*ADAPTIVE, "--min-depth", "4", "--max-depth", "3"),
     "--max-depth 3: must be >= --min-depth 4"),
    ("bench_adaptive_depth.py", (*ADAPTIVE, "--prompts", "9"), "argument --prompts: must be an integer in [1, 8]"),
    ("bench_adaptive_depth.py", (*ADAPTIVE, "--device", "nope"), "argument --device: not a device"),
    ("bench_decode.py", (*DECODE, "--depths", "5,,16"), "argument --depths"),
    ("bench_distill_prefill.py", ("--repeats", "0"), "argument --repeats: must be an integer >= 1"),
    ("bench_distill_prefill.py", ("--injection", "nope"), "argument --injection: invalid choice: 'nope'"),
    ("bench_rl_reuse.py", ("--depths", "5", "0"), "argument --depths: must be an integer >= 1, got '0'"),
    ("bench_tbptt_memory.py", ("--seq", "1"), "argument --seq: must be an integer >= 2"),
    ("bench_vs_plain_pytorch.py", ("--batch", "0"), "argument --batch: must be an integer >= 1"),
    ("bench_vs_refs.py", ("--parcae", "{tmp}/parcae", "--layers", "1", "-1", "1"),
     "argument --layers: must be an integer >= 0, got '-1'"),
    # what the model config refuses while the benchmark builds (a ConfigError): one line, exit 2
    ("bench_vs_refs.py", ("--parcae", "{tmp}/parcae", "--layers", "1", "0", "1"), "model.n_core: a looped model"),
    ("bench_loader.py", ("--seconds", "0"), "argument --seconds: must be a number > 0"),
    ("bench_loader.py", ("--workers", "0,-1"), "argument --workers: must be comma-separated integers >= 0"),
    ("bench_loader.py", ("--synthetic-sequences", "4", "--mbs", "8"),
     "--synthetic-sequences 4: fewer than one micro-batch (--mbs 8)"),
    ("bench_loader_vs_train.py", ("--steps", "11"), "argument --steps: must be an integer >= 12"),
    ("bench_rewards.py", ("--rounds", "0"), "argument --rounds: must be an integer >= 1"),
    ("bench_rewards.py", ("--workers", "0"), "argument --workers: must be comma-separated integers >= 1"),
    ("bench_eval_memory.py", ("--cases", "nope"), "argument --cases: unknown ['nope']"),
    ("bench_eval_memory.py", ("--cases", ","), "argument --cases: no case"),
    ("bench_eval_memory.py", ("--speed", "nope"), "argument --speed: 'nope' is not an evaluate_ppl case"),
    ("bench_eval_memory.py", ("--mmap-threshold", "-1"), "argument --mmap-threshold: must be an integer >= 1"),
    # --name is the result's file name: a folder in it failed when the result was written, after the timing
    ("bench_vs_refs.py", ("--parcae", "{tmp}/parcae", "--name", "sub/x"), "argument --name: must be a file name"),
    ("bench_rl_reuse.py", ("--name", ".."), "argument --name: must be a file name"),
])
def test_bad_option_is_one_line_naming_it(tmp_path, script, argv, message):
    marker = tmp_path / "parcae" / "parcae_lm" / "models" / "parcae" / "parcae.py"  # what --parcae checks for
    marker.parent.mkdir(parents=True)
    marker.write_text("")
    _refused(_run(tmp_path, script, *(a.replace("{tmp}", str(tmp_path)) for a in argv)), script, message)
    assert not (tmp_path / "results").exists()


def test_a_path_that_is_no_checkpoint_is_one_line(tmp_path):
    """What megaloop's loaders refuse while the benchmark builds (a UserError: here CheckpointError) is
    reported like the megaloop commands do, not as a traceback."""
    (tmp_path / "empty").mkdir()
    proc = _run(tmp_path, "bench_adaptive_depth.py", "--checkpoint", str(tmp_path / "empty"), "--reps", "1")
    _refused(proc, "bench_adaptive_depth.py", f"{tmp_path / 'empty'} is not a megaloop checkpoint")


def test_option_checks_accept_the_defaults_and_return_list_options_unchanged():
    """The recorded config / command keep their format: list options stay the given string."""
    sys.path.insert(0, str(BENCH))
    try:
        import common
    finally:
        sys.path.remove(str(BENCH))
    assert common.int_list(1)("5,16") == "5,16" and common.int_list(1, optional=True)("") == ""
    assert common.positive_int("3") == 3 and common.nonnegative_int("0") == 0 and common.positive_float("5.0") == 5.0
    for bad in ("", "1,,2", "x", "0,1"):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated integers >= 1"):
            common.int_list(1)(bad)
    for bad in ("0", "nan", "inf", "-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be a number > 0"):
            common.positive_float(bad)


@pytest.mark.parametrize("where", ["file", "under_file", "dangling"])
def test_an_unusable_results_folder_is_refused_before_any_timing(tmp_path, where):
    """``MEGALOOP_BENCH_RESULTS`` naming a file (or a folder below one, or a dangling link) used to fail
    when the result was written, after the whole benchmark had run."""
    (tmp_path / "f").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    results = {"file": tmp_path / "f", "under_file": tmp_path / "f" / "r", "dangling": tmp_path / "link" / "r"}[where]
    env = {**os.environ, "MEGALOOP_BENCH_RESULTS": str(results), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / "bench_cpu_compat.py"), "--reps", "1"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)
    _refused(proc, "bench_cpu_compat.py", f"MEGALOOP_BENCH_RESULTS={results}: ")
