"""Non-finite loss policy: `skip` drops the update (weights, optimizer and prior untouched) and
aborts after `train.max_nonfinite` in a row; `abort` stops at once, keeping the last finite state."""

import subprocess
import sys

from tests.conftest import ROOT
from tests.train.helpers import env, metrics

WORKER = ROOT / "tests" / "train" / "nonfinite_worker.py"


def _run(tmp_path, policy, steps, *overrides, poison="loss"):
    return subprocess.run([sys.executable, str(WORKER), str(tmp_path), policy, steps, *overrides], cwd=ROOT,
                          env={**env(), "POISON": poison}, capture_output=True, text=True, timeout=600)


def _common(ckpt):
    import torch

    return torch.load(ckpt / "common.pt", weights_only=False)["common"]


def test_skip_policy_skips_update(tmp_path):
    proc = _run(tmp_path, "skip", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[1].get("skipped") == 1 and "prior_probs" not in rows[1]
    assert all(r.get("skipped") is None for r in rows[2:])


def test_consecutive_nonfinite_aborts_and_keeps_last_finite_state(tmp_path):
    proc = _run(tmp_path, "skip", "2,3")
    assert proc.returncode == 3
    assert "non-finite loss at step 3" in proc.stderr
    assert (tmp_path / "checkpoints" / "step_00000002" / "megaloop.json").is_file()


def test_abort_policy(tmp_path):
    proc = _run(tmp_path, "abort", "2")
    assert proc.returncode == 3 and "non-finite loss at step 2" in proc.stderr
    # the saved state is the one before the bad step was counted: steps completed = 1, and the LR
    # schedule and the data position are those after step 1 (the bad step's batches are not skipped)
    ckpt = tmp_path / "checkpoints" / "step_00000001"
    assert (ckpt / "megaloop.json").is_file()
    common = _common(ckpt)
    assert common["step"] == 1 and common["scheduler"]["num_steps"] == 1
    assert [s["sample_in_epoch"] for s in common["loader"]] == [8]  # one step of global batch 8


def test_abort_keeps_a_checkpoint_of_the_same_step(tmp_path):
    # step 2 saved by the interval, step 3 non-finite: the good step-2 checkpoint is not re-saved
    proc = _run(tmp_path, "abort", "3", "train.save_interval=2")
    assert proc.returncode == 3 and "the last finite state (step 2) is already saved" in proc.stdout + proc.stderr
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts == ["step_00000002"]
    common = _common(tmp_path / "checkpoints" / "step_00000002")
    assert common["scheduler"]["num_steps"] == 2 and [s["sample_in_epoch"] for s in common["loader"]] == [16]


def test_abort_at_the_first_step_with_the_distributed_optimizer_saves_and_resumes_exactly(tmp_path):
    """No update applied yet: megatron's distributed optimizer asserted on the never-stepped torch Adam
    (`assert len(steps) == 1`, a traceback) when saving the step-0 state. It is saved with the zero Adam
    state torch creates at its first step, so resuming from it trains as a fresh run does."""
    from tests.train.helpers import run_train

    same = ["train.max_steps=5", "train.save_interval=0", "train.nonfinite=abort", "train.max_nonfinite=1",
            "parallel.distributed_optimizer=true"]
    proc = _run(tmp_path / "a", "abort", "1", "depth.warmup_updates=0", "parallel.distributed_optimizer=true")
    assert proc.returncode == 3 and "AssertionError" not in proc.stderr, proc.stderr[-3000:]
    assert (tmp_path / "a" / "checkpoints" / "step_00000000" / "megaloop.json").is_file()
    assert _common(tmp_path / "a" / "checkpoints" / "step_00000000")["step"] == 0
    run_train(tmp_path / "a", *same, resume="auto")
    run_train(tmp_path / "b", *same)
    resumed = [r["loss"] for r in metrics(tmp_path / "a") if "loss" in r and r.get("skipped") is None]
    fresh = [r["loss"] for r in metrics(tmp_path / "b") if "loss" in r]
    assert len(fresh) == 5 and resumed[-5:] == fresh, (resumed, fresh)


def test_a_non_finite_gradient_with_a_finite_loss_is_not_applied(tmp_path):
    """Only the loss was checked: a NaN gradient (finite loss) went through the optimizer unclipped,
    the weights turned NaN, and that state was saved as "the last finite state"."""
    proc = _run(tmp_path / "skip", "skip", "2", poison="grad")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path / "skip")
    assert rows[1]["skipped"] == 1 and rows[1]["skipped_steps_total"] == 1 and rows[1]["loss"] == rows[1]["loss"]
    assert all(r.get("skipped") is None and r["loss"] == r["loss"] for r in rows[2:])  # later losses finite
    proc = _run(tmp_path / "abort", "abort", "2", poison="grad")
    assert proc.returncode == 3 and "non-finite gradient (loss " in proc.stderr and "at step 2" in proc.stderr
    assert _common(tmp_path / "abort" / "checkpoints" / "step_00000001")["step"] == 1


def test_a_bad_batch_on_one_rank_stops_every_rank_with_its_message(tmp_path):
    """At DP=2 the rank that read a bad token id mid-run stopped with its line while the other died in
    its next collective: a gloo 'Connection closed by peer' traceback, exit 1."""
    status = tmp_path / "status"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "train" / "bad_batch_worker.py"), str(tmp_path / "run"), "1", "3"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**env(), "MEGALOOP_EXIT_STATUS_FILE": str(status)},
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and status.read_text().strip() == "2", out[-3000:]
    for rank in (0, 1):  # each rank stops with the line (torchrun then prints its own ChildFailedError report)
        assert (f"megaloop: error (rank {rank}): dataset D: token id 5000 outside the vocabulary [0, 4096) its "
                "manifest.json records (found by rank 1)") in out, out[-3000:]
    assert "Connection closed" not in out and "RuntimeError" not in out, out[-3000:]  # no rank died in a collective


def test_a_run_that_ends_inside_a_skipped_streak_says_so(tmp_path):
    """A run shorter than train.max_nonfinite steps of NaN ended with exit 0 and no word."""
    proc = _run(tmp_path, "skip", "5", "train.max_nonfinite=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning: 1 of the run's 5 steps were skipped as non-finite, the last 1 in a row" in proc.stdout
