"""A SIGTERM / SIGINT that arrives during the last step (``Trainer.run``) ends the run normally: the
final checkpoint is written and the exit code is 0, not the requeue (75) or interrupt (130) code,
because there is nothing left to resume."""

from __future__ import annotations

import signal

import pytest

from megaloop.config import load_config

pytestmark = pytest.mark.usefixtures("megatron_world", "one_thread")  # tests/conftest.py

SMALL = ["train.global_batch_size=4", "train.micro_batch_size=2", "train.max_steps=3", "train.save_interval=0",
         "optim.warmup_steps=1", "logging.progress=false", "train.eval_batches=1"]


@pytest.mark.parametrize("sig, early_code", [(signal.SIGTERM, 75), (signal.SIGINT, 130)])
def test_signal_during_the_last_step_completes_the_run(tmp_path, capsys, sig, early_code):
    from megaloop.train.trainer import Trainer

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # SIG_IGN in a background job

    def run_with_signal_at(step: int, run_dir) -> int:
        t = Trainer(load_config("tiny", SMALL), run_dir)
        step_fn = t.train_step

        def train_step():
            rec = step_fn()
            if t.step == step:
                signal.raise_signal(sig)  # delivered to run()'s handler while this step finishes
            return rec

        t.train_step = train_step
        return t.run()

    assert run_with_signal_at(3, tmp_path / "last") == 0
    out = capsys.readouterr().out
    assert "signal received during the last step: the run is complete at step 3" in out
    assert (tmp_path / "last" / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    # the control: the same signal one step earlier stops the run with its code, checkpointed at step 2
    assert run_with_signal_at(2, tmp_path / "early") == early_code
    assert (tmp_path / "early" / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    # run() put the handlers back
    assert {s: signal.getsignal(s) for s in before} == before
