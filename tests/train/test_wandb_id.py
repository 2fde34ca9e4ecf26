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


def test_a_rewind_renews_the_id_before_any_checkpoint_moves(tmp_path):
    """A resume from an older checkpoint that stopped after setting the newer ones aside but before
    the logger wrote a new id (SIGTERM during set-up, a data error) left the old id: the next
    ``--resume auto`` (nothing left to set aside) logged the redone steps into the old wandb run,
    twice over with other values. The trainer's ``_rewind`` replaces the id first."""
    from types import SimpleNamespace

    from megaloop.train.checkpoint import CheckpointManager
    from megaloop.train.run_dir import set_aside_newer
    from megaloop.train.trainer import Trainer
    from tests.train.test_checkpoint_faults import _fake_checkpoint

    root = tmp_path / "checkpoints"
    older, newer = _fake_checkpoint(root, 8), _fake_checkpoint(root, 12)
    old_id = wandb_run_id(tmp_path, "run", new=True)
    trainer = SimpleNamespace(run_dir=tmp_path, cfg=SimpleNamespace(logging=LoggingConfig(name="run")))
    seen = []

    def rewind():
        seen.append(newer.is_dir())  # nothing moved yet
        Trainer._rewind(trainer)

    moved = set_aside_newer(CheckpointManager(root), older, on_rewind=rewind)
    assert seen == [True] and [m.name for m in moved] == ["step_00000012"] and trainer.rewound
    renewed = (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert renewed not in ("", old_id)
    # the launch stops here; the next one resumes the newest left (step 8), not a rewind: the new id
    assert wandb_run_id(tmp_path, "run", new=False) == renewed
    assert set_aside_newer(CheckpointManager(root), older, on_rewind=rewind) == [] and seen == [True]
    # resuming another run's checkpoint into this folder is another line of history too
    set_aside_newer(CheckpointManager(root), _fake_checkpoint(tmp_path / "other" / "checkpoints", 4), on_rewind=rewind)
    assert len(seen) == 2 and (tmp_path / WANDB_ID_FILE).read_text().strip() not in (old_id, renewed)
    # a new folder holds no id to replace: nothing written (the logger makes one), so a set-up that
    # fails after this leaves the folder as empty as before (the run directory lock removes it)
    fresh = SimpleNamespace(run_dir=tmp_path / "fresh", cfg=trainer.cfg)
    fresh.run_dir.mkdir()
    Trainer._rewind(fresh)
    assert fresh.rewound and not any(fresh.run_dir.iterdir())
    # a folder from before RUN/wandb_id (wandb/ holds the run named after the folder): renewed too (review)
    legacy = SimpleNamespace(run_dir=tmp_path / "legacy", cfg=trainer.cfg)
    (legacy.run_dir / "wandb" / "offline-run-20261201_101010-run").mkdir(parents=True)
    Trainer._rewind(legacy)
    assert wandb_run_id(legacy.run_dir, "run", new=False).startswith("run-")
