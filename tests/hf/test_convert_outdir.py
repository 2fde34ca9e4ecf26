"""``megaloop convert --out``: refused before anything loads when it cannot be created or lies inside
a checkpoints folder; the staging folder failing to appear is one line.

Before: ``--out /proc/self/hf`` loaded the checkpoint and built the model, then failed with a
``[rank0]`` traceback (FileNotFoundError on '/proc/self/.hf.megaloop-tmp-NNN'), and an ``--out``
inside the run's ``checkpoints/`` folder (or inside a ``step_*`` checkpoint) was accepted.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def run(megatron_world, tmp_path_factory):
    """A run directory with one small checkpoint (no tokenizer: the export warns and goes on)."""
    from megaloop.config import RunConfig
    from megaloop.data.config import DataConfig
    from megaloop.model.build import build_model
    from megaloop.model.config import ModelConfig
    from megaloop.train.checkpoint import CheckpointManager

    root = tmp_path_factory.mktemp("outdir") / "run"
    cfg = ModelConfig(hidden_size=64, num_heads=4, seq_len=32, vocab_size=250)
    chunks, _ = build_model(cfg, vocab_size=250, tp=1, pp=1, vpp=None, sequence_parallel=False, seed=5, ddp=False)
    conf = RunConfig(model=cfg, data=DataConfig(path=str(root / "no-data"))).to_dict()
    CheckpointManager(root / "checkpoints").save(3, chunks, None, common={"step": 3, "tokens": 0, "config": conf})
    return root


def _not_loaded(*_a, **_k):
    raise AssertionError("the checkpoint was loaded before --out was refused")


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("out", ["/proc/self/hf", "/proc/self/a/b/hf"])
def test_an_out_that_cannot_be_created_is_refused_before_loading(run, monkeypatch, capsys, out):
    import megaloop.hf.convert as convert
    from megaloop.hf.convert_cli import main

    monkeypatch.setattr(convert, "load_native", _not_loaded)
    assert main(["--checkpoint", str(run), "--out", out, "--no-validate"]) == 2
    line = _one_line(capsys)
    assert f"error: --out {out}: /proc/self is not writable (cannot create a file in it:" in line
    assert main(["--from-hf", "--checkpoint", str(run), "--out", out]) == 2  # and the way back
    assert "/proc/self is not writable" in _one_line(capsys)


def test_the_export_names_a_staging_folder_it_cannot_create(run):
    """The API (no CLI probe): a ConversionError naming --out, not a FileNotFoundError traceback."""
    from megaloop.hf.convert import ConversionError, convert_to_hf

    with pytest.raises(ConversionError, match=r"^--out /proc/self/hf: the export cannot be staged beside it "
                                              r"\(/proc/self/\.hf\.megaloop-tmp-[\w-]+-\d+: .*\); nothing was written$"):
        convert_to_hf(run, "/proc/self/hf", validate=False, log=lambda *_: None)


def test_an_out_inside_a_checkpoints_folder_is_refused(run, tmp_path, monkeypatch, capsys):
    import megaloop.hf.convert as convert
    from megaloop.hf.convert_cli import _check_args, build_parser, main

    ckpts = run / "checkpoints"
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    monkeypatch.setattr(convert, "load_native", _not_loaded)
    for out, holder in ((ckpts / "hf", ckpts), (ckpts / "step_00000003" / "hf", ckpts / "step_00000003"),
                        (ckpts / "exports" / "a" / "hf", ckpts)):
        assert main(["--checkpoint", str(run), "--out", str(out), "--no-validate"]) == 2
        line = _one_line(capsys)
        assert f"--out {out} lies inside the checkpoint folder {holder}:" in line, line
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing written
    # a folder that is merely named "checkpoints" (no megaloop checkpoint in it) is fine, as is RUN/hf
    (tmp_path / "checkpoints").mkdir()
    for out in (tmp_path / "checkpoints" / "hf", run / "hf"):
        _check_args(build_parser().parse_args(["--checkpoint", str(run), "--out", str(out)]))


def test_an_export_is_replaced_only_when_it_holds_nothing_else(run, tmp_path, capsys):
    """Re-exporting into an earlier export used to delete whatever else was in it (a model card, a
    checkpoint converted back into it, even the checkpoint being converted). Now such an --out is
    refused with the foreign names, before loading; a clean earlier export is replaced, and an --out
    inside an export (either direction) is refused."""
    from megaloop.hf.convert import ConversionError, convert_to_hf, foreign_entries
    from megaloop.hf.convert_cli import main

    hf = tmp_path / "hf"
    assert main(["--checkpoint", str(run), "--out", str(hf), "--no-validate"]) == 0
    report = json.loads((hf / "megaloop_conversion.json").read_text())
    assert report["files"] == sorted(p.name for p in hf.iterdir()) and foreign_entries(hf) == []
    assert main(["--checkpoint", str(run), "--out", str(hf), "--no-validate"]) == 0  # a clean export: replaced
    capsys.readouterr()
    for inside in (["--from-hf", "--checkpoint", str(hf), "--out", str(hf / "back")],
                   ["--checkpoint", str(run), "--out", str(hf / "sub" / "again"), "--no-validate"]):
        assert main(inside) == 2
        assert f"lies inside the Hugging Face export {hf}:" in _one_line(capsys)
    (hf / "README.md").write_text("model card")
    (hf / "notes").mkdir()
    (hf / "notes" / "x.txt").write_text("mine")
    before = sorted((p.relative_to(hf), p.stat().st_mtime_ns) for p in hf.rglob("*"))
    assert main(["--checkpoint", str(run), "--out", str(hf), "--no-validate"]) == 2
    line = _one_line(capsys)
    assert f"--out {hf} is an earlier export that also holds README.md, notes, which no export writes" in line, line
    with pytest.raises(ConversionError, match=r"holds README\.md, notes, which the earlier export there did not write"):
        convert_to_hf(run, hf, validate=False, log=lambda *_: None)  # the API refuses too, at the rename
    assert sorted((p.relative_to(hf), p.stat().st_mtime_ns) for p in hf.rglob("*")) == before
    assert not list(tmp_path.glob(".hf.megaloop-tmp-*"))
    # an export written before the file list: known names (and its weight shards) only
    report.pop("files")
    (hf / "megaloop_conversion.json").write_text(json.dumps(report))
    (hf / "model-00001-of-00002.safetensors").write_text("")
    (hf / "recurrence_megaloop.py").write_text("")  # a code file earlier releases exported
    assert foreign_entries(hf) == ["README.md", "notes"]


def test_exported_weights_follow_the_umask(run, tmp_path):
    """safetensors writes through a 0600 file: the weights were unreadable to the group while the
    folder's other files followed the umask."""
    import os
    import stat

    from megaloop.hf.convert_cli import main

    for mask, mode in ((0o022, 0o644), (0o027, 0o640)):
        old = os.umask(mask)
        try:
            out = tmp_path / f"hf{mask:o}"
            assert main(["--checkpoint", str(run), "--out", str(out), "--no-validate", "--max-shard-size", "20KB"]) == 0
        finally:
            os.umask(old)
        shards = list(out.glob("*.safetensors"))
        assert len(shards) > 1
        assert {stat.S_IMODE(f.stat().st_mode) for f in [*shards, out / "config.json"]} == {mode}


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_converts_staging_folder_is_swept(run, tmp_path, capsys):
    """SIGKILL (or a node failure) during an export left ``.OUT.megaloop-tmp-*`` with a whole export in
    it, which no later convert removed; one killed between moving the earlier export aside and
    renaming the new one in left --out missing."""
    import os

    from megaloop.hf.convert_cli import main
    from megaloop.hf.staging import _host, sweep_stale

    hf = tmp_path / "hf"
    assert main(["--checkpoint", str(run), "--out", str(hf), "--no-validate"]) == 0
    dead, host = _dead_pid(), _host()
    stale = tmp_path / f".hf.megaloop-tmp-{host}-{dead}"
    (stale / "hf").mkdir(parents=True)
    (stale / "hf" / "model.safetensors").write_bytes(b"x" * 1000)
    live = tmp_path / f".hf.megaloop-tmp-{host}-{os.getppid()}"  # a convert still running
    other = tmp_path / f".hf.megaloop-tmp-elsewhere-{dead}"  # another node's: its pids are not ours
    for keep in (live, other):
        (keep / "hf").mkdir(parents=True)
    capsys.readouterr()
    assert main(["--checkpoint", str(run), "--out", str(hf), "--no-validate"]) == 0
    assert f"removed {stale}, the staging folder of an interrupted convert (pid {dead})" in capsys.readouterr().out
    assert not stale.exists() and live.is_dir() and other.is_dir()
    # killed after moving the earlier export aside: it is put back, then the staging folder goes
    moved = tmp_path / f".hf.megaloop-tmp-{host}-{dead}"
    moved.mkdir()
    files = sorted(p.name for p in hf.iterdir())
    hf.rename(moved / "hf.old")
    notes: list[str] = []
    sweep_stale(hf, notes.append)
    assert sorted(p.name for p in hf.iterdir()) == files and not moved.exists()
    assert notes[0].startswith(f"note: restored the earlier export {hf}")


def test_sigterm_during_an_export_removes_its_staging_folder(run, tmp_path):
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT, clean_env

    out = tmp_path / "hf"
    code = "\n".join([
        "import os, signal, megaloop.cli, megaloop.hf.convert as c",
        "c.plain_mode = lambda *a: signal.raise_signal(signal.SIGTERM)  # the weights are in the staging folder",
        f"megaloop.cli.main(['convert', '--checkpoint', {str(run)!r}, '--out', {str(out)!r}, '--no-validate'])"])
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**clean_env(), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "megaloop convert: stopped by SIGTERM (its temporary files removed; --out is never left half-written)" \
        in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".hf.megaloop-tmp-*"))


def test_a_stop_between_the_two_renames_keeps_the_earlier_export(run, tmp_path, monkeypatch):
    """Replacing an export moves the earlier one aside, then renames the new one in; a Ctrl-C or
    SIGTERM between the two deleted the earlier export with the staging folder, leaving no --out."""
    from pathlib import Path

    from megaloop.hf.convert import convert_to_hf

    hf = tmp_path / "hf"
    convert_to_hf(run, hf, validate=False, log=lambda *_: None)
    files = sorted(p.name for p in hf.iterdir())
    real = Path.rename

    def rename(self, target):
        if Path(target) == hf and self.name == "hf" and self.parent.name.startswith(".hf.megaloop-tmp-"):
            raise KeyboardInterrupt  # the new export is complete, the earlier one already moved aside
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    notes: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        convert_to_hf(run, hf, validate=False, log=notes.append)
    assert sorted(p.name for p in hf.iterdir()) == files
    assert any(n.startswith(f"note: restored the earlier export {hf}") for n in notes)
    assert not list(tmp_path.glob(".hf.megaloop-tmp-*"))
