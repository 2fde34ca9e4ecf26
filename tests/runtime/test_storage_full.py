"""A write that storage refuses (full disk, quota, ``ulimit -f``) is one line in every command
(megaloop/runtime/files.py ``storage_full``/``report_storage_full``, megaloop/cli.py, the data_prep scripts): train's
set-up, convert, rl/distill saves, eval, lr-screen and the data-prep tools printed tracebacks."""

from __future__ import annotations

import errno

import pytest

from megaloop.runtime.files import storage_full


def test_storage_full_names_the_error_and_file_else_none() -> None:
    assert storage_full(OSError(errno.ENOSPC, "No space left on device", "/d/x.json")) == \
        "no space left on device (ENOSPC, /d/x.json)"
    assert storage_full(OSError(errno.EFBIG, "File too large")) == "file too large (EFBIG)"
    torch_zip = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
    assert "the disk is probably full, or the file-size limit" in storage_full(torch_zip)
    assert storage_full(Exception("I/O error: No space left on device (os error 28)")).startswith("I/O error")
    try:  # a wrapper raised from the OSError
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded", "/q/f")
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as outer:
        assert storage_full(outer) == "disk quota exceeded (EDQUOT, /q/f)"
    assert storage_full(ValueError("a bug")) is None
    try:  # a bug inside an `except OSError` handler is no full disk (it lost its traceback)
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise KeyError("a bug in the handler")
    except KeyError as bug:
        assert storage_full(bug) is None
    assert storage_full(OSError(errno.EACCES, "Permission denied", "/x")) is None


def test_a_full_disk_in_any_verb_is_one_line_exit_1(monkeypatch, capsys) -> None:
    import megaloop.cli as cli
    import megaloop.plan.cli as plan_cli

    def full(argv):  # noqa: ARG001
        raise OSError(errno.ENOSPC, "No space left on device", "/full/plan.json")

    monkeypatch.setattr(plan_cli, "main", full)
    monkeypatch.setenv("MEGALOOP_EXIT_STATUS_FILE", "")
    with pytest.raises(SystemExit) as stop:
        cli.main(["plan", "--config", "tiny"])
    assert stop.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["megaloop plan: error: no space left on device (ENOSPC, /full/plan.json); files this "
                   "command finished before are kept; free space (or raise the limit) and rerun it"], err

    def bug(argv):  # noqa: ARG001
        raise ValueError("a bug keeps its traceback")

    monkeypatch.setattr(plan_cli, "main", bug)
    with pytest.raises(ValueError, match="a bug keeps its traceback"):
        cli.main(["plan", "--config", "tiny"])


def test_efbig_names_the_file_size_limit(monkeypatch) -> None:
    """EFBIG from a write with no file name (streaming's shared memory under `ulimit -f`) read as a full
    disk; it now names the limit."""
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda what: (1000 * 1024, resource.RLIM_INFINITY))
    assert storage_full(OSError(errno.EFBIG, "File too large")) == \
        "file too large (EFBIG); the file-size limit (ulimit -f) is 1,000 KiB"
