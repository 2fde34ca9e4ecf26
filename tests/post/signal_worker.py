"""Worker (not collected by pytest): ``megaloop rl`` / ``distill-prefill`` command lines run through
``megaloop.cli.main`` (the entry point of ``python -m megaloop.cli``: exit status, status file) one
after the other in this process, each sent real signals by this process (``os.kill``) at chosen
training steps, so where a run stops does not depend on timing::

    python tests/post/signal_worker.py JSON            # or under torchrun (DeepSpeed, gloo)

``JSON``: a list of ``{"argv": [...], "signals": [[NAME, STEP, WHEN, RANK], ...], "status_file": PATH}``:
``NAME`` is sent at training step ``STEP`` (0-based: the step that takes the run from STEP to STEP + 1
steps done), ``WHEN`` ``before`` it runs or (``megaloop rl`` only) ``after`` it ran (still inside the
step, before the loop's save and record), by global rank ``RANK`` only (null: every rank). ``status_file`` becomes
``MEGALOOP_EXIT_STATUS_FILE``. Prints ``RESULT {"i", "rank", "rc"}`` per command on every rank.

``--task digits`` (registered here for the tests): single-digit additions rewarded by the share of
digits and spaces in the completion, graded so that the tiny model's groups have advantages and every
step updates the weights (the exact-answer reward of ``arithmetic`` is 0 for it: no update at all)."""

from __future__ import annotations

import json
import os
import signal
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

PLAN: list[list] = []


def digit_share(example, completion: str) -> float:
    return sum(ch.isdigit() or ch == " " for ch in completion) / max(1, len(completion))


def _send(step: int, when: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    for name, at, w, who in PLAN:
        if at == step and w == when and who in (None, rank):
            signal.raise_signal(getattr(signal, name))


def _install() -> None:
    import megaloop.post.distill.prefill_student as ps
    from megaloop.post.rl import tasks
    from megaloop.post.rl.grpo import GRPOTrainer

    tasks.TASKS["digits"] = lambda: tasks.CallableRewardTask(tasks.ArithmeticTask("+"), digit_share, name="digits")
    step = GRPOTrainer.step

    def rl_step(self):
        at = self.step_no
        _send(at, "before")
        out = step(self)
        _send(at, "after")
        return out

    GRPOTrainer.step = rl_step
    lr_at = ps.lr_at

    def distill_lr_at(cfg, at):  # called once at the start of each training step of train_student
        _send(at, "before")
        return lr_at(cfg, at)

    ps.lr_at = distill_lr_at


def main() -> int:
    import torch

    from megaloop.cli import main as cli_main

    torch.set_num_threads(1)
    _install()
    for i, cmd in enumerate(json.loads(sys.argv[1])):
        PLAN[:] = cmd.get("signals", [])
        if cmd.get("status_file"):
            os.environ["MEGALOOP_EXIT_STATUS_FILE"] = cmd["status_file"]
        else:
            os.environ.pop("MEGALOOP_EXIT_STATUS_FILE", None)
        try:
            cli_main(cmd["argv"])
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        print("RESULT " + json.dumps({"i": i, "rank": int(os.environ.get("RANK", "0")), "rc": rc}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
