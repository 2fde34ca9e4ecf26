"""Where an output would be created (megaloop/runtime/files.py: nearest_existing, dangling_link) and
every command's check of it: a dangling link on the way is refused in one line naming the link and
its target, before any work (it used to be walked past to the writable folder above it, so the check
passed and the command failed at its end, when ``mkdir`` said "File exists")."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from megaloop.errors import UserError
from megaloop.runtime.files import dangling_link, nearest_existing


@pytest.fixture()
def link(tmp_path: Path) -> Path:
    """``tmp_path/res``: a link to a folder that does not exist (an unmounted scratch space)."""
    (tmp_path / "res").symlink_to(tmp_path / "gone")
    return tmp_path / "res"


def test_nearest_existing_stops_at_a_link_and_names_it(tmp_path: Path, link: Path) -> None:
    assert nearest_existing(tmp_path / "a" / "b" / "c") == tmp_path
    assert nearest_existing(tmp_path) == tmp_path
    assert nearest_existing(link / "run" / "out.json") == link
    assert nearest_existing(Path("relative-that-is-not-there") / "x") == Path(".")
    assert dangling_link(link) == f"{link} is a link to {tmp_path / 'gone'}, which does not exist"
    assert dangling_link(tmp_path) is None
    (tmp_path / "chain").symlink_to(link)
    assert dangling_link(tmp_path / "chain") == (f"{tmp_path / 'chain'} is a link to {link}, which leads to "
                                                 f"{tmp_path / 'gone'}, which does not exist")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert dangling_link(tmp_path / "loop") == f"{tmp_path / 'loop'} is a link to {tmp_path / 'loop'} that " \
        "leads back to itself (a loop of links)"
    (tmp_path / "gone").mkdir()
    assert dangling_link(link) is None and nearest_existing(link / "run") == link


def _convert_args(out: Path, ckpt: Path) -> argparse.Namespace:
    return argparse.Namespace(from_hf=False, dtype="fp32", no_validate=False, tokenizer=None, depth=None,
                              max_shard_size="2GB", out=str(out), checkpoint=str(ckpt))


def test_every_output_check_refuses_a_dangling_link(tmp_path: Path, link: Path) -> None:
    from megaloop.data._fsutil import check_out_writable
    from megaloop.hf.convert_cli import _check_args
    from megaloop.inference.generate_cli import check_out_file
    from megaloop.post.runs import check_writable
    from megaloop.sweep_out import check_out_dir

    onto = tmp_path / "out.json"  # a file link whose target's folder is missing: written through, it fails
    onto.symlink_to(tmp_path / "gone" / "out.json")
    named = f"{link} is a link to {tmp_path / 'gone'}, which does not exist"
    checks = {
        "eval --json": lambda: check_out_file(str(link / "sub" / "out.json"), "--json"),
        "eval --json onto a link": lambda: check_out_file(str(onto), "--json"),
        "convert --out": lambda: _check_args(_convert_args(link / "export", tmp_path)),
        "data --out": lambda: check_out_writable(link / "mds"),
        "rl --out": lambda: check_writable(link / "rl"),
        "sweep --out": lambda: check_out_dir(str(link / "screen")),
    }
    for what, check in checks.items():
        with pytest.raises(UserError) as err:
            check()
        assert (named if "onto" not in what else f"{onto} is a link to {tmp_path / 'gone' / 'out.json'}, "
                "which does not exist") in str(err.value), (what, str(err.value))
    # the same checks pass once the link points somewhere (and create nothing)
    (tmp_path / "gone").mkdir()
    for check in checks.values():  # (the file link now points at a file that can be created)
        check()
    assert list((tmp_path / "gone").iterdir()) == []


def test_sweep_out_in_a_folder_no_file_can_be_created_in(tmp_path: Path) -> None:
    from megaloop.sweep_out import check_out_dir

    with pytest.raises(UserError, match=r"--out: /proc/self/megaloop-screen: no file can be created in /proc/self"):
        check_out_dir("/proc/self/megaloop-screen")
    check_out_dir("/proc/self/megaloop-screen", probe=False)  # --dry-run writes nothing: not probed


def test_eval_json_is_written_whole_or_not_at_all(tmp_path: Path, monkeypatch, capsys) -> None:
    """`eval`/`generate --json` rewrote the file in place: a full disk (or a kill) mid-write left an
    earlier good result truncated (0 bytes or cut JSON) and a traceback. Now a temp file and a rename:
    the earlier file stays whole and the failure is one line; a link is written through."""
    import errno
    import json
    import os

    from megaloop.inference.generate_cli import write_json
    from megaloop.runtime import files

    good = tmp_path / "res.json"
    good.write_text('{"ok": 1}')
    real_fsync = os.fsync

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(UserError, match=r"--json: cannot write .*res.json: No space left on device"):
        write_json(str(good), {"ppl": 1.0})
    assert good.read_text() == '{"ok": 1}' and [p.name for p in tmp_path.iterdir()] == ["res.json"]
    monkeypatch.setattr(files.os, "fsync", real_fsync)
    (tmp_path / "via").symlink_to(good)
    write_json(str(tmp_path / "via"), {"ppl": float("nan")})
    assert (tmp_path / "via").is_symlink() and json.loads(good.read_text()) == {"ppl": None}
    assert "wrote" in capsys.readouterr().out


def test_eval_json_to_a_stream_is_written_directly() -> None:
    """`--json /dev/stdout` worked before the atomic write (a temp file beside /proc/self/fd/1 cannot be made)."""
    import subprocess
    import sys

    from tests.conftest import ROOT, clean_env

    code = "from megaloop.inference.generate_cli import write_json; write_json('/dev/stdout', {'ppl': 2.5})"
    proc = subprocess.run([sys.executable, "-c", code], env={**clean_env(), "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith('{\n "ppl": 2.5\n}\n') and "wrote /dev/stdout" in proc.stdout
