"""Runs the trainer with a non-finite loss injected at chosen steps (argv: run_dir policy steps [overrides...])."""

import os
import sys
import warnings


warnings.filterwarnings("ignore")
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))

from megaloop.cli import main  # noqa: E402
from megaloop.train.trainer import Trainer  # noqa: E402


if __name__ == "__main__":  # checkpoint saving spawns a helper process that re-imports this file
    run_dir, policy, bad = sys.argv[1], sys.argv[2], {int(s) for s in sys.argv[3].split(",")}
    orig = Trainer._run_schedule


    grad = os.environ.get("POISON") == "grad"  # a NaN in one gradient entry, the loss left finite

    def poisoned(self, mbs, forward_only, **kwargs):
        ce = orig(self, mbs, forward_only, **kwargs)
        if not forward_only and self.step + 1 in bad:
            if grad:
                self.model[0].buffers[0].grad_data[0] = float("nan")
            else:
                ce[0, 0] = float("nan")
        return ce


    Trainer._run_schedule = poisoned
    main(["train", "--config", "tiny", "--run-dir", run_dir, "train.max_steps=5", "train.save_interval=0",
          "train.global_batch_size=8", "train.micro_batch_size=4", "optim.warmup_steps=1",
          "train.eval_batches=1", f"train.nonfinite={policy}", "train.max_nonfinite=1", "logging.progress=false",
          *sys.argv[4:]])
