"""`megaloop train` under torchrun where one rank meets a bad batch mid-run (argv: run_dir rank step
[overrides...]): that rank's read raises the DataError the loader raises for a token id outside the vocabulary."""

import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))

from megaloop.cli import main  # noqa: E402
from megaloop.data.errors import DataError  # noqa: E402
from megaloop.train.trainer import Trainer  # noqa: E402

if __name__ == "__main__":
    run_dir, bad_rank, bad_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    orig = Trainer._microbatches

    def reads(self, step, depths, loader_iter):
        out = orig(self, step, depths, loader_iter)
        if self.rank == bad_rank and step + 1 == bad_step:
            raise DataError("dataset D: token id 5000 outside the vocabulary [0, 4096) its manifest.json records")
        return out

    Trainer._microbatches = reads
    main(["train", "--config", "tiny", "--run-dir", run_dir, "train.max_steps=4", "train.save_interval=0",
          "train.global_batch_size=8", "train.micro_batch_size=4", "optim.warmup_steps=1", "train.eval_batches=1",
          "logging.progress=false", *sys.argv[4:]])
