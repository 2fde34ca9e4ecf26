"""What a run may do to its --run-dir: nothing already written is lost, no setting silently ignored."""

import fcntl
import os
from pathlib import Path

from tests.train.helpers import metrics, run_train


def _snapshot(d):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != ".megaloop.lock"}


def _one_error_line(proc):
    lines = [l for l in proc.stderr.splitlines() if l.strip() and "warn" not in l.lower()]
    assert len(lines) == 1, lines
    return lines[0]


def test_fresh_run_into_a_directory_with_checkpoints_is_refused(tmp_path):
    run_train(tmp_path, "train.max_steps=2", "train.save_interval=0")
    before = _snapshot(tmp_path)
    proc = run_train(tmp_path, "train.max_steps=2", "train.save_interval=0", expect=2)
    line = _one_error_line(proc)
    assert str(tmp_path) in line and "step_00000002" in line and "--resume auto" in line
    assert _snapshot(tmp_path) == before  # metrics.jsonl, config.yaml and the checkpoint untouched


def test_resume_from_an_older_step_keeps_the_newer_checkpoints(tmp_path):
    """Resuming step 2 of a run that reached step 4 sets step 4 aside (not pruned, not overwritten)
    and the resumed run's own saves survive pruning (keep=1), with `latest` naming the last one."""
    run_train(tmp_path, "train.max_steps=4", "train.save_interval=2", "train.keep_checkpoints=2")
    ck = tmp_path / "checkpoints"
    step4 = _snapshot(ck / "step_00000004")
    history = (tmp_path / "metrics.jsonl").read_text()
    proc = run_train(tmp_path, "train.max_steps=4", "train.save_interval=1", "train.keep_checkpoints=1",
                     "train.stop_after=3", resume=str(ck / "step_00000002"))
    assert "step_00000004 moved to" in proc.stdout
    assert _snapshot(ck / "superseded" / "step_00000004") == step4
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000003"]
    assert (ck / "latest").read_text().strip() == "step_00000003"
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3]
    kept = list(tmp_path.glob("metrics.jsonl.*"))  # the set-aside steps' lines are kept beside it
    assert len(kept) == 1 and kept[0].read_text() == history and f"stay in {kept[0].name}" in proc.stdout
    run_train(tmp_path, "train.max_steps=4", "train.save_interval=1", "train.keep_checkpoints=1",
              resume="auto")
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000004"]
    assert (ck / "superseded" / "step_00000004").is_dir()


def test_resume_paths_and_foreign_checkpoints(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    run_train(a, "train.max_steps=2", "train.save_interval=0")
    run_train(b, "train.max_steps=2", "train.save_interval=0")
    before = _snapshot(b)
    # another directory's checkpoint into a directory holding checkpoints
    line = _one_error_line(run_train(b, "train.max_steps=3", resume=str(a / "checkpoints" / "step_00000002"),
                                     expect=2))
    assert "is not a checkpoint of --run-dir" in line and str(b) in line
    assert _snapshot(b) == before
    # a run dir or checkpoints dir resolves to its newest checkpoint; a file or an empty dir is named
    c = tmp_path / "c"
    proc = run_train(c, "train.max_steps=3", "train.save_interval=0", resume=str(a))
    assert "resumed from" in proc.stdout and "step_00000002" in proc.stdout
    (tmp_path / "afile").write_text("x")
    assert "is not a directory" in _one_error_line(run_train(tmp_path / "d", resume=str(tmp_path / "afile"),
                                                             expect=2))
    assert not (tmp_path / "d").exists()  # a refused run leaves no run directory it created behind
    line = _one_error_line(run_train(tmp_path / "afile", "train.max_steps=2", expect=2))  # a file as --run-dir
    assert f"--run-dir {tmp_path / 'afile'}: cannot be used as a run directory" in line, line
    assert (tmp_path / "afile").read_text() == "x"
    (tmp_path / "link").symlink_to(tmp_path / "gone")  # a run dir under a link that points nowhere
    line = _one_error_line(run_train(tmp_path / "link" / "run", "train.max_steps=2", expect=2))
    assert f"{tmp_path / 'link'} is a link to {tmp_path / 'gone'}, which does not exist" in line, line
    # --resume auto refuses a newest checkpoint whose megaloop.json does not parse, as --resume PATH does
    meta = a / "checkpoints" / "step_00000002" / "megaloop.json"
    meta.write_text(meta.read_text()[:12])
    for resume in ("auto", str(meta.parent)):
        line = _one_error_line(run_train(a, "train.max_steps=3", resume=resume, expect=2))
        assert "megaloop.json is unreadable" in line and "not written by a finished save" in line, line
    (tmp_path / "empty").mkdir()
    assert "is not a megaloop checkpoint" in _one_error_line(run_train(tmp_path / "d", resume=str(tmp_path / "empty"),
                                                                       expect=2))


def test_changed_optim_settings_on_resume_are_refused(tmp_path):
    run_train(tmp_path, "train.max_steps=4", "train.save_interval=0", "train.stop_after=2")
    before = _snapshot(tmp_path)
    line = _one_error_line(run_train(tmp_path, "train.max_steps=4", "optim.lr=0.001", "optim.schedule=cosine",
                                     resume="auto", expect=2))
    assert "optim.lr=0.003" in line and "optim.schedule='wsd'" in line and "this run: 0.001" in line
    assert _snapshot(tmp_path) == before
    # the optimizer's layout: the plain optimizer crashed on the distributed one's state (KeyError
    # 'pre_wd_mult' traceback, exit 1); named before loading now
    line = _one_error_line(run_train(tmp_path, "train.max_steps=4", "parallel.distributed_optimizer=false",
                                     resume="auto", expect=2))
    assert "holds distributed optimizer state (parallel.distributed_optimizer=true; this run: false)" in line, line
    assert "resume with parallel.distributed_optimizer=true" in line and "train.init_weights=" in line, line
    assert _snapshot(tmp_path) == before
    # another seq_len: "data loader state was saved on a different dataset (94298 vs 47147 samples)"
    line = _one_error_line(run_train(tmp_path, "train.max_steps=4", "model.seq_len=64", resume="auto", expect=2))
    assert "was trained with model.seq_len=128 (this run: 64)" in line and "resume with model.seq_len=128" in line, line
    assert _snapshot(tmp_path) == before
    # another precision: it trained on in bf16 and rewrote config.yaml as if the run had been bf16 throughout
    line = _one_error_line(run_train(tmp_path, "train.max_steps=4", "model.bf16=true", resume="auto", expect=2))
    assert "was trained with model.bf16=false (this run: true); resume with model.bf16=false" in line, line
    assert _snapshot(tmp_path) == before


def test_a_run_directory_in_use_is_refused(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    fd = os.open(tmp_path / ".megaloop.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"pid 4242 on somehost\n")
        line = _one_error_line(run_train(tmp_path, "train.max_steps=2", expect=2))
        assert "another megaloop run is using it" in line and "pid 4242" in line
        assert not (tmp_path / "metrics.jsonl").exists()
    finally:
        os.close(fd)
    run_train(tmp_path, "train.max_steps=2", "train.save_interval=0")  # free again


def test_a_dataset_folder_is_not_a_run_directory(tmp_path):
    """--run-dir that is (or lies in) data.path, an MDS folder or a raw TxT360-layout tree is refused
    before the lock file, config.yaml or checkpoints are written into it."""
    import pytest

    from megaloop.data.synthetic import write_synthetic_mds
    from megaloop.train.run_dir import RunDirError, check_run_dir_location

    mds = tmp_path / "mds"
    write_synthetic_mds(mds, num_sequences=40, seq_len=128, vocab_size=512, seed=0)
    raw = tmp_path / "txt360" / "data" / "common-crawl" / "CC-MAIN-2013-20"
    raw.mkdir(parents=True)
    (raw / "0.jsonl").write_text('{"text": "x"}\n')
    cases = [(mds, {"data.path": str(mds)}, "is the dataset data.path="),
             (mds / "run", {"data.path": str(mds)}, "is inside the dataset data.path="),
             (mds, {"data.path": "default"}, "holds index.json: it is a dataset folder"),
             (tmp_path / "txt360", {}, "holds a raw text tree"),
             (tmp_path / "val" / "x", {"data.val_path": str(tmp_path / "val")}, None)]  # val missing: loader names it
    for run_dir, paths, message in cases:
        if message is None:
            check_run_dir_location(run_dir, paths)
            continue
        with pytest.raises(RunDirError, match=message):
            check_run_dir_location(run_dir, paths)
    check_run_dir_location(tmp_path / "runs" / "a", {"data.path": str(mds)})  # a run folder beside the data
    before = _snapshot(mds)
    line = _one_error_line(run_train(mds, f"data.path={mds}", "train.max_steps=2", expect=2))
    assert f"--run-dir {mds} is the dataset data.path={mds}" in line
    assert _snapshot(mds) == before and not (mds / ".megaloop.lock").exists() and not (mds / "checkpoints").exists()


def test_a_run_directory_removed_while_training_stops_at_the_next_save(tmp_path):
    """`rm -rf RUN` mid-run: the next save recreated RUN/checkpoints without the lock, so a second run
    could take the folder and both trained into it (one's metrics and checkpoints lost)."""
    import shutil
    import subprocess
    import time

    from tests.conftest import ROOT
    from tests.train.helpers import env, train_cmd

    run = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(run, "train.max_steps=400", "train.save_interval=2", "train.eval_interval=0"),
                            cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=(tmp_path / "err").open("w"))
    deadline = time.time() + 300
    while time.time() < deadline and not (run / "checkpoints" / "step_00000002").is_dir():
        time.sleep(0.1)
    for _ in range(50):  # the run may be writing into it at that moment
        shutil.rmtree(run, ignore_errors=True)
        if not run.exists():
            break
        time.sleep(0.05)
    assert proc.wait(timeout=300) == 2
    err = (tmp_path / "err").read_text().strip().splitlines()
    assert any(line.startswith(f"megaloop: error: --run-dir {run}: removed or replaced while this run "
                               "trained") for line in err), err[-5:]
    # (a save already under way when the folder went may have recreated it; no later save does)


def test_a_damaged_shard_of_the_embedded_corpus_is_named_before_the_run_dir_is_written(tmp_path):
    """The embedded set was left out of the set-up check ("ours"): a damaged shard of it in the cache was
    named only after config.yaml, data.json, tokenizer.json and metrics.jsonl had been written."""
    import shutil

    from megaloop.data.dataset_checks import default_cache_dir
    from megaloop.data.loaders import resolve_data_path

    src = Path(resolve_data_path("default", 128, None, "train")).parent  # CACHE/default-<key>
    cache = tmp_path / "cache"
    def link(a: str, b: str) -> None:  # links (never written through), copies across file systems
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    for folder in [src, *default_cache_dir().glob("default-tokenizer-*")]:
        shutil.copytree(folder, cache / folder.name, copy_function=link, ignore=shutil.ignore_patterns("*.lock"))
    shard = sorted((cache / src.name / "train" / "parts").glob("*/shard.*.mds.zstd"))[-1]  # not the first batch's
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.unlink()  # a file of its own, not the link to the shared cache's
    shard.write_bytes(bytes(data))
    run = tmp_path / "run"
    proc = run_train(run, "train.max_steps=12", f"data.cache_dir={cache}", expect=2)
    # the set-up check's words (the loader's, "failed its xxh64 check ... while being copied", came later,
    # whenever streaming first copied the shard: on a warm slot after the run dir was written)
    assert f"data.path=default: MDS shard {shard} is corrupt: its content does not match" in proc.stderr, \
        proc.stderr[-2000:]
    assert not run.exists()


def test_the_wsd_shape_is_refused_for_its_own_reason_and_only_under_wsd(tmp_path):
    """``decay_fraction``/``decay_style`` are not in megatron's scheduler state (the refusal said they
    would come back from it), and a cosine run resumed with another (unused) decay_style was refused."""
    import pytest

    from megaloop.config import OptimConfig
    from megaloop.config_utils import ConfigError
    from megaloop.train.run_dir import check_saved_optim

    saved = OptimConfig(schedule="cosine", warmup_steps=8).__dict__ | {}
    check_saved_optim(tmp_path, saved, OptimConfig(schedule="cosine", warmup_steps=8, decay_style="cosine",
                                                   decay_fraction=0.5))
    saved = OptimConfig().__dict__ | {}
    with pytest.raises(ConfigError) as info:
        check_saved_optim(tmp_path, saved, OptimConfig(decay_style="cosine"))
    msg = str(info.value)
    assert "optim.decay_style='linear' (this run: 'cosine')" in msg and "rebuilt from the config" in msg, msg
    assert "would override" not in msg, msg
    with pytest.raises(ConfigError, match=r"optim.lr=0.003 \(this run: 0.001\), optim.decay_fraction=0.2 \(this run: "
                                          r"0.5\); its optimizer and schedule state would override .*; the WSD decay"):
        check_saved_optim(tmp_path, saved, OptimConfig(lr=1e-3, decay_fraction=0.5))


def test_a_null_partition_resumed_records_the_checkpoints():
    """A resume with data.num_canonical_nodes=null trains the checkpoint's partition; config.yaml wrote
    null, and a re-run of it at another DP size derived another order (review)."""
    from megaloop.config import load_config
    from megaloop.train.run_dir import keep_init_fields

    cfg = load_config("tiny", ["data.num_canonical_nodes=null"])
    keep_init_fields({"data": {"num_canonical_nodes": 1}}, cfg)
    assert cfg.data.num_canonical_nodes == 1
    cfg = load_config("tiny", ["data.num_canonical_nodes=2"])
    keep_init_fields({"data": {"num_canonical_nodes": 1}}, cfg)  # explicit: the loader refuses it, not this
    assert cfg.data.num_canonical_nodes == 2
