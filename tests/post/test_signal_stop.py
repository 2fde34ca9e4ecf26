"""Graceful stop on signals of ``megaloop rl`` / ``megaloop distill-prefill`` (megaloop/runtime/stop.py), as
``megaloop train`` does: SIGTERM / SIGUSR1 / Ctrl-C during training checkpoint at the next step boundary
(whatever ``--save-every``: these runs use none), print one line and exit 75 / 130 (the status reaches
``MEGALOOP_EXIT_STATUS_FILE``); ``--resume`` then finishes exactly as the uninterrupted run. A second
Ctrl-C stops at once without a checkpoint; a signal during the last step lets the run complete (exit 0).

The runs go through ``megaloop.cli.main`` in one worker process (tests/post/signal_worker.py), which
sends itself real signals (``os.kill``) at chosen steps, so where a run stops does not depend on timing.
Tolerance: none. On CPU the resumed run's final weights, its per-step records (without the wall-clock
fields) and held-out metrics equal the uninterrupted run's bit for bit (the checkpoint holds the weights
and the optimizer state, rollouts and batches are functions of (seed, step)); so do the 2-process ZeRO-2
runs, whose stop is asked for by one rank only."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, clean_env, run_torchrun, tagged_json

WORKER = ROOT / "tests" / "post" / "signal_worker.py"
TIMING = ("rollout_s", "update_s", "seconds")  # wall-clock fields of the per-step records


def _worker(cmds: list[dict]) -> tuple[dict[int, int], str]:
    """Run the commands in one worker process: ``({command index: exit status}, output)``."""
    env = {**clean_env(), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, str(WORKER), json.dumps(cmds)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    rcs = {r["i"]: r["rc"] for r in _results(out)}
    if proc.returncode != 0 or len(rcs) != len(cmds):
        pytest.fail(f"signal worker: exit {proc.returncode} after {len(rcs)} of {len(cmds)} commands "
                    f"(a signal that killed it?):\n{out[-4000:]}")
    return rcs, out


def _results(out: str) -> list[dict]:
    return tagged_json(out)


def _records(path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in path.read_text().splitlines() if line.strip()]


def _same_weights(a, b) -> None:
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    assert x.keys() == y.keys()
    differ = [k for k in x if not torch.equal(x[k], y[k])]
    assert not differ, f"weights differ: {differ[:5]}"


def _steps(out_dir) -> list[str]:
    ckpt = out_dir / "checkpoints"
    return sorted(p.name for p in ckpt.glob("step*")) if ckpt.is_dir() else []


# ----------------------------------------------------------------------------- megaloop rl
def _rl(hf_dir, out, steps: int, *extra: str) -> list[str]:
    return ["rl", "--model", str(hf_dir), "--out", str(out), "--task", "digits", "--depth", "2", "--neumann-b", "2",
            "--group-size", "4", "--prompts", "2", "--max-new-tokens", "3", "--lr", "1e-3", "--steps", str(steps),
            "--device", "cpu", *extra]


@pytest.fixture(scope="module")
def rl_runs(tiny_teacher, tmp_path_factory):
    _, hf = tiny_teacher
    w = tmp_path_factory.mktemp("rl_signals")
    cmds = [{"argv": _rl(hf, w / "full", 4)},
            {"argv": _rl(hf, w / "term", 4), "signals": [["SIGTERM", 1, "before", None]],
             "status_file": str(w / "term_status")},
            {"argv": _rl(hf, w / "term", 4, "--resume")},
            {"argv": _rl(hf, w / "int", 4), "signals": [["SIGINT", 1, "after", None]],
             "status_file": str(w / "int_status")},
            {"argv": _rl(hf, w / "int2", 4), "signals": [["SIGINT", 1, "before", None], ["SIGINT", 1, "after", None]]},
            {"argv": _rl(hf, w / "last", 2), "signals": [["SIGUSR1", 1, "before", None]],
             "status_file": str(w / "last_status")}]
    rcs, out = _worker(cmds)
    return w, rcs, out


def test_rl_sigterm_checkpoints_exits_75_and_resume_equals_the_uninterrupted_run(rl_runs):
    w, rcs, out = rl_runs
    assert rcs[0] == 0 and rcs[1] == 75 and rcs[2] == 0, out[-3000:]
    assert (w / "term_status").read_text().strip() == "75"  # what slurm/common.sh requeues on
    line = f"megaloop rl: stopped by SIGTERM at step 2: checkpoint {w / 'term' / 'checkpoints' / 'step000002'} " \
           "written; continue with --resume (exit 75)"
    assert line in out.splitlines(), out[-3000:]
    # the step the signal came in finished; --save-every 0, yet the stop checkpointed (then the resume's end)
    side = json.loads((w / "term" / "checkpoints" / "step000002" / "rl_run.json").read_text())
    assert side["step"] == 2 and side["tool"] == "megaloop rl"
    assert _steps(w / "term") == ["step000002", "step000004"]
    assert "resumed at step 2 from" in out
    full, term = _records(w / "full" / "metrics.jsonl"), _records(w / "term" / "metrics.jsonl")
    assert [r["step"] for r in term] == [0, 1, 2, 3] and term == full
    assert all(r["grad_norm"] for r in full)  # every step updated the weights: the comparison is not empty
    _same_weights(w / "full" / "model.safetensors", w / "term" / "model.safetensors")
    assert json.loads((w / "term" / "megaloop_rl.json").read_text())["final"]["step"] == 3


def test_rl_ctrl_c_checkpoints_and_exits_130_a_second_stops_at_once(rl_runs):
    w, rcs, out = rl_runs
    assert rcs[3] == 130 and (w / "int_status").read_text().strip() == "130", out[-3000:]
    assert "interrupted: checkpointing after the current step, then exiting (Ctrl-C again to stop at once" in out
    assert f"megaloop rl: interrupted (Ctrl-C) at step 2: checkpoint {w / 'int' / 'checkpoints' / 'step000002'} " \
           "written; continue with --resume (exit 130)" in out
    assert _steps(w / "int") == ["step000002"] and len(_records(w / "int" / "metrics.jsonl")) == 2
    assert not (w / "int" / "megaloop_rl.json").exists()
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    # Ctrl-C twice in one step: out at once, no checkpoint, the command's one line
    assert rcs[4] == 130 and _steps(w / "int2") == []
    assert "megaloop rl: interrupted (no checkpoint was written, nothing to --resume: run it again)" in out


def test_rl_signal_during_the_last_step_lets_the_run_complete(rl_runs):
    w, rcs, out = rl_runs
    assert rcs[5] == 0 and (w / "last_status").read_text().strip() == "0", out[-3000:]
    assert (w / "last" / "megaloop_rl.json").is_file() and _steps(w / "last") == []
    assert "megaloop rl: signal received during the last step or the final writes: the run is complete at step 2" \
        in out


# ----------------------------------------------------------------------------- megaloop distill-prefill
def _distill(hf_dir, data, out, steps: int, *extra: str) -> list[str]:
    return ["distill-prefill", "--teacher", str(hf_dir), "--out", str(out), "--data", str(data), "--depth", "2",
            "--batch-size", "2", "--seq-len", "16", "--calib-batches", "1", "--eval-batches", "1", "--steps",
            str(steps), "--device", "cpu", *extra]


@pytest.fixture(scope="module")
def distill_runs(tiny_teacher, tmp_path_factory):
    _, hf = tiny_teacher
    w = tmp_path_factory.mktemp("distill_signals")
    data = w / "data.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    cmds = [{"argv": _distill(hf, data, w / "full", 4)},
            {"argv": _distill(hf, data, w / "term", 4), "signals": [["SIGTERM", 2, "before", None]],
             "status_file": str(w / "term_status")},
            {"argv": _distill(hf, data, w / "term", 4, "--resume")},
            # the stop lands on a --save-every step: that checkpoint is the stop's (not written twice)
            {"argv": _distill(hf, data, w / "int", 4, "--save-every", "2"), "signals": [["SIGINT", 1, "before", None]],
             "status_file": str(w / "int_status")},
            {"argv": _distill(hf, data, w / "last", 2), "signals": [["SIGTERM", 1, "before", None]]}]
    rcs, out = _worker(cmds)
    return w, rcs, out


def test_distill_sigterm_checkpoints_exits_75_and_resume_equals_the_uninterrupted_run(distill_runs):
    w, rcs, out = distill_runs
    assert rcs[0] == 0 and rcs[1] == 75 and rcs[2] == 0, out[-3000:]
    assert (w / "term_status").read_text().strip() == "75"
    assert (f"megaloop distill-prefill: stopped by SIGTERM at step 3: checkpoint "
            f"{w / 'term' / 'checkpoints' / 'step000003'} written; continue with --resume (exit 75)") in out
    side = json.loads((w / "term" / "checkpoints" / "step000003" / "distill_run.json").read_text())
    assert side["step"] == 3 and side["tool"] == "megaloop distill-prefill"
    assert _steps(w / "term") == ["step000003", "step000004"] and "resumed at step 3 from" in out
    full, term = _records(w / "full" / "metrics.jsonl"), _records(w / "term" / "metrics.jsonl")
    assert [r["step"] for r in term] == [0, 1, 2, 3] and term == full
    _same_weights(w / "full" / "student.safetensors", w / "term" / "student.safetensors")
    a, b = (json.loads((w / d / "student.json").read_text()) for d in ("full", "term"))
    assert a["eval_after"] == b["eval_after"] and a["final_train"]["loss"] == b["final_train"]["loss"]


def test_distill_ctrl_c_checkpoints_and_exits_130_and_last_step_signal_completes(distill_runs):
    w, rcs, out = distill_runs
    assert rcs[3] == 130 and (w / "int_status").read_text().strip() == "130", out[-3000:]
    assert (f"megaloop distill-prefill: interrupted (Ctrl-C) at step 2: checkpoint "
            f"{w / 'int' / 'checkpoints' / 'step000002'} written; continue with --resume (exit 130)") in out
    assert _steps(w / "int") == ["step000002"] and not (w / "int" / "student.json").exists()
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    assert rcs[4] == 0 and (w / "last" / "student.json").is_file() and _steps(w / "last") == []
    assert "megaloop distill-prefill: signal received during the last step or the final writes: the run is " \
           "complete at step 2" in out


# ----------------------------------------------------------------------------- 2 processes, DeepSpeed ZeRO-2
def test_rl_zero2_a_signal_on_one_rank_stops_every_rank_and_resumes_exactly(tiny_teacher, tmp_path):
    """SIGUSR1 (slurm's warning) reaches rank 1 only: the all-reduce at the step boundary stops both ranks
    at the same step, both checkpoint (ZeRO shards) and exit 75, rank 0 writes the status file; a
    2-process --resume ends with the uninterrupted 2-process run's weights."""
    _, hf = tiny_teacher
    w = tmp_path
    ds = ("--deepspeed", "zero2")
    cmds = [{"argv": _rl(hf, w / "full", 3, *ds)},
            {"argv": _rl(hf, w / "cut", 3, *ds), "signals": [["SIGUSR1", 0, "before", 1]],
             "status_file": str(w / "status")},
            {"argv": _rl(hf, w / "cut", 3, *ds, "--resume")}]
    out = run_torchrun(WORKER, 2, json.dumps(cmds), env={"DS_ACCELERATOR": "cpu"})
    rcs = {(r["i"], r["rank"]): r["rc"] for r in _results(out)}
    assert rcs == {(0, 0): 0, (0, 1): 0, (1, 0): 75, (1, 1): 75, (2, 0): 0, (2, 1): 0}, out[-3000:]
    assert (w / "status").read_text().strip() == "75"
    assert "megaloop rl: stopped by SIGUSR1 at step 1" in out
    assert len(list((w / "cut" / "checkpoints" / "step000001").glob("*optim_states.pt"))) == 2
    assert _records(w / "cut" / "metrics.jsonl") == _records(w / "full" / "metrics.jsonl")
    _same_weights(w / "full" / "model.safetensors", w / "cut" / "model.safetensors")


# ----------------------------------------------------------------------------- the handler itself
def test_signal_stop_ranks_signals_and_restores_the_handlers():
    from megaloop.runtime.stop import SignalStop, exit_code

    # raise_signal: delivered to this (the main) thread and handled before it returns. os.kill(getpid()) may
    # land on pytest-xdist's I/O thread and reach the handler later, after the `raises` block: a
    # KeyboardInterrupt there ended the test worker (INTERNALERROR)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    with SignalStop(lead=False) as stop:
        assert stop.agreed() == 0
        signal.raise_signal(signal.SIGTERM)  # handled: only a flag
        signal.raise_signal(signal.SIGUSR1)
        assert stop.agreed() == signal.SIGTERM and exit_code(stop.agreed()) == 75
        signal.raise_signal(signal.SIGINT)  # Ctrl-C counts over SIGTERM/SIGUSR1
        assert stop.agreed() == signal.SIGINT and exit_code(signal.SIGINT) == 130
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # a second Ctrl-C: at once
    assert {s: signal.getsignal(s) for s in before} == before
