"""The wandb run id of a run directory (megaloop/train/metrics.py): recorded in RUN/wandb_id, continued by
a resume from the newest checkpoint; a run started before the file existed keeps its old id; a fresh
start or a rewind with wandb off drops a stale file (a later wandb resume would continue the run the
redone steps left behind)."""

from __future__ import annotations

from megaloop.config import LoggingConfig
from megaloop.train.metrics import WANDB_ID_FILE, MetricsLogger, wandb_run_id


def test_the_id_is_recorded_continued_and_renewed(tmp_path):
    first = wandb_run_id(tmp_path, "my run/1", new=True)
    assert first.startswith("my_run_1-") and (tmp_path / WANDB_ID_FILE).read_text().strip() == first
    assert wandb_run_id(tmp_path, "my run/1", new=False) == first
    assert wandb_run_id(tmp_path, "my run/1", new=True) not in ("", first)
    (tmp_path / "other").mkdir()
    assert wandb_run_id(tmp_path / "other", "my run/1", new=True) != first  # another folder, another run


def test_a_run_from_before_the_file_keeps_its_old_id(tmp_path):
    (tmp_path / "wandb" / "offline-run-20261201_101010-arm").mkdir(parents=True)
    assert wandb_run_id(tmp_path, "arm", new=False) == "arm"  # the id megaloop used before RUN/wandb_id
    assert (tmp_path / WANDB_ID_FILE).read_text().strip() == "arm"
    (tmp_path / "fresh").mkdir()
    assert wandb_run_id(tmp_path / "fresh", "arm", new=False).startswith("arm-")  # nothing held: a new one


def test_a_fresh_start_or_rewind_without_wandb_drops_a_stale_id(tmp_path):
    for start, rewound, kept in ((0, False, False), (5, True, False), (5, False, True)):
        (tmp_path / WANDB_ID_FILE).write_text("old-id\n")
        log = MetricsLogger(tmp_path, LoggingConfig(wandb="disabled", progress=False), enabled=True, total_steps=9,
                            start_step=start, config_dict={}, rewound=rewound)
        log.close()
        assert (tmp_path / WANDB_ID_FILE).exists() is kept, (start, rewound)
