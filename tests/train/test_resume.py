"""Interrupted + resumed runs equal uninterrupted ones (bitwise on CPU); bad checkpoints fail clearly."""

import math
import shutil
import signal

import pytest

from megaloop.config import load_config
from megaloop.model.config import param_count
from tests.train.helpers import metrics, run_train, signal_after

STEPS = ["train.max_steps=8", "train.save_interval=0"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    run_train(d, *STEPS)
    return metrics(d)


def _same(a, b):
    keys = ("step", "loss", "depths", "prior_probs", "lr", "tokens", "model_flops_total",
            "target_tokens_total", "depth_counts")
    assert [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b]


def test_stop_after_then_resume_is_bitwise(tmp_path, uninterrupted):
    proc = run_train(tmp_path, *STEPS, "train.stop_after=3")
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3]
    # the run states its size at start, counted as `megaloop plan` counts it (it printed none)
    total = param_count(load_config("tiny", []).model, 4096)["total"]
    assert f"model: {total:,} parameters (" in proc.stdout and total == 1_918_592
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    # a re-run of the same stopped command (a screen point launched again) trains nothing, and says so
    proc = run_train(tmp_path, *STEPS, "train.stop_after=2", resume="auto")
    assert "nothing to train: the checkpoint's step 3 is at or past train.stop_after=2" in proc.stdout
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3]
    # init-only settings changed on resume have no effect, and the run says so (they were silent)
    proc = run_train(tmp_path, *STEPS, "depth.init=uniform", "train.init_seed=7", resume="auto")
    assert ("note: depth.init=uniform (checkpoint: pln), train.init_seed=7 (checkpoint: None) set up a new "
            "run's initial state") in proc.stdout
    _same(metrics(tmp_path), uninterrupted)
    # ... and config.yaml records the initial state the run has, so re-running it trains this run
    # (it recorded the new values: a re-run of config.yaml differed from step 1)
    saved = load_config(str(tmp_path / "config.yaml"))
    assert (saved.depth.init, saved.train.init_seed) == ("pln", None)


def test_counters_count_every_step_across_log_interval_and_resume(tmp_path, uninterrupted):
    """With log_interval > 1 the cumulative counters still cover every step, and a resumed run
    continues them from its checkpoint: the last record equals the per-step sums of an
    uninterrupted log_interval=1 run (Table 2's FLOPs column needs this)."""
    run_train(tmp_path, *STEPS, "train.log_interval=3", "train.eval_interval=2", "train.stop_after=4")
    assert [r["step"] for r in metrics(tmp_path)] == [2, 3, 4]  # every evaluation is logged
    run_train(tmp_path, *STEPS, "train.log_interval=3", "train.eval_interval=2", resume="auto")
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [2, 3, 4, 6, 8]
    assert [r["step"] for r in rows if "val_ce" in r] == [2, 4, 6, 8]
    last = rows[-1]
    assert last["step"] == 8
    assert last["model_flops_total"] == pytest.approx(sum(r["model_flops"] for r in uninterrupted), rel=1e-12)
    assert last["target_tokens_total"] == sum(r["target_tokens"] for r in uninterrupted)
    hist = {}
    for r in uninterrupted:
        for d in r["depths"]:
            hist[str(d)] = hist.get(str(d), 0) + 1
    assert last["depth_counts"] == dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
    from megaloop.train.summary import summarize

    s = summarize(tmp_path)
    assert s["steps"] == 8 and s["model_flops"] == last["model_flops_total"]
    assert s["microbatches"] == sum(len(r["depths"]) for r in uninterrupted)


def test_bf16_distributed_optimizer_resume_is_bitwise(tmp_path):
    """The GPU presets' precision path (bf16 params in megatron's Float16Module, FP32 master
    weights in the distributed optimizer) stops and resumes exactly too."""
    bf16 = ["train.max_steps=6", "train.save_interval=0", "model.bf16=true",
            "parallel.distributed_optimizer=true"]
    full = tmp_path / "full"
    run_train(full, *bf16)
    run_train(tmp_path / "cut", *bf16, "train.stop_after=2")
    run_train(tmp_path / "cut", *bf16, resume="auto")
    _same(metrics(tmp_path / "cut"), metrics(full))
    losses = [r["loss"] for r in metrics(full)]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_sigterm_checkpoints_and_requeues(tmp_path, uninterrupted):
    code, out, err = signal_after(tmp_path, signal.SIGTERM, *STEPS)
    assert code == 75, (out + err)[-3000:]
    stopped_at = metrics(tmp_path)[-1]["step"]
    assert 3 <= stopped_at < 8
    assert (tmp_path / "checkpoints" / f"step_{stopped_at:08d}" / "megaloop.json").is_file()
    run_train(tmp_path, *STEPS, resume="auto")
    _same(metrics(tmp_path), uninterrupted)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_group_signal_with_loader_workers_checkpoints_and_requeues(tmp_path, uninterrupted, sig):
    """A stop signal to the whole process group (torchrun's forwarding, slurm, `kill -- -PGID`) also reached
    the DataLoader's worker processes, which died of it: "DataLoader worker (pid N) is killed by signal:
    Terminated", exit 1, no checkpoint (S/M/L have data.num_workers=2). Resumed with other workers, exact."""
    code, out, err = signal_after(tmp_path, sig, *STEPS, "data.num_workers=2", group=True)
    assert code == 75, (out + err)[-3000:]
    assert "killed by signal" not in err and "Traceback" not in err, err[-3000:]
    stopped_at = metrics(tmp_path)[-1]["step"]
    assert 3 <= stopped_at < 8 and (tmp_path / "checkpoints" / f"step_{stopped_at:08d}" / "megaloop.json").is_file()
    run_train(tmp_path, *STEPS, "data.num_workers=1", resume="auto")
    _same(metrics(tmp_path), uninterrupted)


def test_ctrl_c_checkpoints_and_exits_130_then_resumes_exactly(tmp_path, uninterrupted):
    code, out, err = signal_after(tmp_path, signal.SIGINT, *STEPS)
    assert code == 130, (out + err)[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "interrupted: checkpointing at step" in out
    stopped = metrics(tmp_path)[-1]["step"]
    assert 3 <= stopped < 8 and (tmp_path / "checkpoints" / f"step_{stopped:08d}" / "megaloop.json").is_file()
    # another seed is refused before any step: the checkpoint's depth draws and data order keep its own
    bad = run_train(tmp_path, *STEPS, "train.seed=5", "data.shuffle_seed=7", resume="auto", expect=2)
    assert ("was trained with train.seed=1234 (this run: 5), data.shuffle_seed=1234 (this run: 7); its depth "
            "sampler and data order keep the checkpoint's seeds. Resume with train.seed=1234 "
            "data.shuffle_seed=1234, or start a new run") in bad.stderr
    assert metrics(tmp_path)[-1]["step"] == stopped
    run_train(tmp_path, *STEPS, resume="auto")
    _same(metrics(tmp_path), uninterrupted)


def test_corrupt_checkpoint_is_reported_and_kept(tmp_path):
    run_train(tmp_path, "train.max_steps=2", "train.save_interval=0")
    ckpt = tmp_path / "checkpoints" / "step_00000002"
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncate
    before = sorted(p.name for p in ckpt.iterdir())
    proc = run_train(tmp_path, "train.max_steps=4", resume="auto", expect=2)
    assert "step_00000002" in proc.stderr and "could not be read" in proc.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == before  # nothing overwritten
    # an interrupted save (no megaloop.json) is never taken as latest
    half = tmp_path / "checkpoints" / "step_00000009"
    shutil.copytree(ckpt, half)
    (half / "megaloop.json").unlink()
    proc = run_train(tmp_path, "train.max_steps=4", resume=str(half), expect=2)
    assert "incomplete" in proc.stderr


def test_bad_config_fails_before_compute(tmp_path):
    proc = run_train(tmp_path, "model.num_heads=3", expect=2)
    assert "model.num_heads" in proc.stderr
    proc = run_train(tmp_path, "model.injection=nope", expect=2)
    assert "model.injection" in proc.stderr
    proc = run_train(tmp_path, "parallel.tp=2", expect=2)  # 1 process cannot host tp=2
    assert "world size 1" in proc.stderr
    proc = run_train(tmp_path, f"data.path={tmp_path / 'no_such_data'}", expect=2)
    assert f"data.path={tmp_path / 'no_such_data'}" in proc.stderr and "does not exist" in proc.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_wandb_offline_logging(tmp_path):
    """logging.wandb=offline writes a local wandb run beside metrics.jsonl (no network). Its id is the
    run directory's (RUN/wandb_id), continued by a resume: it was ``logging.name`` or the folder's name,
    so reproduce's seeds of one arm (one logging.name) and runs/a/x beside runs/b/x were one wandb run;
    a resume from an older checkpoint (later steps redone with other values) gets a new one."""
    a, b = tmp_path / "a" / "x", tmp_path / "b" / "x"
    common = ("train.max_steps=4", "train.save_interval=2", "logging.wandb=offline", "logging.name=arm")
    run_train(a, *common, "train.stop_after=2")
    run_train(b, *common, "train.stop_after=2", "train.seed=2")
    assert [r["step"] for r in metrics(a)] == [1, 2]
    runs = list((a / "wandb").glob("offline-run-*"))
    assert runs and any(p.suffix == ".wandb" for p in runs[0].iterdir())
    first = (a / "wandb_id").read_text().strip()
    assert first.startswith("arm-") and first != (b / "wandb_id").read_text().strip()
    run_train(a, *common, resume="auto")  # steps 3-4: the same wandb run
    assert (a / "wandb_id").read_text().strip() == first and [r["step"] for r in metrics(a)] == [1, 2, 3, 4]
    run_train(a, *common, "optim.clip_grad=0.5", resume=str(a / "checkpoints" / "step_00000002"))
    assert (a / "wandb_id").read_text().strip() not in ("", first)  # steps 3-4 again, other values: a new run


def test_extending_the_horizon_continues_the_stable_phase(tmp_path):
    """A run saved in its WSD stable phase, resumed with a longer train.max_steps, follows the
    new horizon: its LRs equal an uninterrupted run at the new horizon (not lr=0 past the old one).
    The checkpoint is the last stable step (8 of 10; the decay is updates 9 and 10), the usual
    branch point, which was refused as "in its decay phase"."""
    run_train(tmp_path / "short", "train.max_steps=10", "train.save_interval=8", "train.stop_after=8",
              "optim.decay_fraction=0.2")
    shutil.copytree(tmp_path / "short", tmp_path / "ext")
    proc = run_train(tmp_path / "ext", "train.max_steps=20", "train.save_interval=0", "optim.decay_fraction=0.2",
                     resume="auto")
    assert "schedule horizon 10 -> 20" in proc.stdout + proc.stderr
    run_train(tmp_path / "long", "train.max_steps=20", "train.save_interval=0", "optim.decay_fraction=0.2")
    ext = [r for r in metrics(tmp_path / "ext") if r["step"] > 8]
    long = [r for r in metrics(tmp_path / "long") if r["step"] > 8]
    lr_ext, lr_long = [r["lr"] for r in ext], [r["lr"] for r in long]
    assert lr_ext == pytest.approx(lr_long, rel=1e-12)
    assert [r["loss"] for r in ext] == [r["loss"] for r in long]  # the first 8 updates were the same
    assert min(lr_ext[:8]) > 0  # steps 9..16 sit in the stable phase of the 20-step horizon
    assert lr_ext[-1] == pytest.approx(0.0, abs=1e-12)


def test_extending_a_run_in_its_decay_is_refused(tmp_path):
    """A checkpoint already in its decay cannot silently re-warm: one line naming both horizons."""
    run_train(tmp_path, "train.max_steps=10", "train.save_interval=9", "train.stop_after=9",
              "optim.decay_fraction=0.3")
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    proc = run_train(tmp_path, "train.max_steps=30", "optim.decay_fraction=0.3", resume="auto", expect=2)
    err = [l for l in proc.stderr.splitlines() if l.strip() and "warn" not in l.lower()]
    assert len(err) == 1, err
    assert "train.max_steps=30" in err[0] and "horizon 10" in err[0] and "decay phase" in err[0]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


def test_horizon_rule_on_the_schedule_alone():
    from megaloop.config import OptimConfig
    from megaloop.train.schedule import check_horizon_change, lr_at

    o = OptimConfig(lr=1e-3, warmup_steps=10, decay_fraction=0.2)
    assert check_horizon_change(o, 100, 400, 50) is None  # stable in both
    assert check_horizon_change(o, 100, 400, 5) is None  # warm-up in both
    assert "decay phase" in check_horizon_change(o, 100, 400, 90)
    assert "nothing left" in check_horizon_change(o, 100, 40, 50)
    assert check_horizon_change(o, 400, 100, 50) is None  # shortening while stable in both
    # the last stable step (update 80 at the peak; the decay is updates 81-100) is the WSD branch point
    assert check_horizon_change(o, 100, 400, 80) is None
    assert "decay phase" in check_horizon_change(o, 100, 400, 81)
    # shortening a stable run into a decay that would already have begun: refused, not "decay phase"
    msg = check_horizon_change(o, 400, 100, 85)
    assert "stable phase" in msg and "decay phase" not in msg and "update 85 ran at LR 0.001" in msg
    assert check_horizon_change(o, 100, 101, 100) is None  # one more step after a finished decay: LR 0 either way
    done = check_horizon_change(o, 100, 200, 100)  # a finished run: resuming at its old horizon trains nothing
    assert "has finished its schedule" in done and "Resume with train.max_steps=100" not in done
    assert lr_at(o, 100, 100) == pytest.approx(0.0) and lr_at(o, 100, 50) == pytest.approx(1e-3)
    cos = OptimConfig(lr=1e-3, warmup_steps=10, schedule="cosine")
    assert "cosine" in check_horizon_change(cos, 100, 400, 50)
    assert check_horizon_change(cos, 100, 400, 10) is None  # still in (the end of) its warm-up


def test_checkpoint_from_before_embed_scale_is_not_resumed_under_the_new_default(tmp_path):
    """A checkpoint whose config has no model.embed_scale (written before it existed, unscaled
    embeddings) is refused under today's default √d, naming the override that resumes it."""
    run_train(tmp_path, "train.max_steps=4", "train.save_interval=2", "train.stop_after=2")
    _forget_saved_field(tmp_path, "embed_scale")
    assert "model.embed_scale=1.0" in _resume_refusal(tmp_path)
    run_train(tmp_path, "train.max_steps=4", "model.embed_scale=1.0", resume="auto")


def _forget_saved_field(run_dir, name: str) -> None:
    """Drop model.<name> from the step-2 checkpoint's saved config (a config from before the field)."""
    import torch

    common = run_dir / "checkpoints" / "step_00000002" / "common.pt"
    state = torch.load(common, weights_only=False)
    del state["common"]["config"]["model"][name]
    torch.save(state, common)


def _resume_refusal(run_dir) -> str:
    """The one error line of a refused ``--resume auto`` (exit 2)."""
    proc = run_train(run_dir, "train.max_steps=4", resume="auto", expect=2)
    err = [l for l in proc.stderr.splitlines() if l.strip() and "warn" not in l.lower()]
    assert len(err) == 1, err
    return err[0]


def test_checkpoint_of_another_model_is_refused_naming_the_fields_and_overrides(tmp_path):
    """A checkpoint trained without QK-norm (the default before it became one) is refused under
    today's default, naming model.qk_norm and the override that resumes it, also when its config
    predates the field (read as what such runs trained with); with the override it resumes."""
    run_train(tmp_path, "train.max_steps=4", "train.save_interval=2", "train.stop_after=2", "model.qk_norm=false")
    for legacy in (False, True):
        if legacy:  # a config written before model.qk_norm existed
            _forget_saved_field(tmp_path, "qk_norm")
        err = _resume_refusal(tmp_path)
        assert "model.qk_norm: checkpoint False, this run True" in err, err
        assert err.endswith("resume it with model.qk_norm=false"), err
    run_train(tmp_path, "train.max_steps=4", "model.qk_norm=false", resume="auto")
    assert [r["step"] for r in metrics(tmp_path)][-1] == 4
