"""How the harnesses record and refuse reference checkouts: the commit as git reports it (packed refs
too), and a checkout of another revision or an incomplete one refused in one line (exit 2)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.tools.test_bench_args import _refused, _run

BENCH = ROOT / "tools" / "bench"


@pytest.fixture
def refs():
    sys.path.insert(0, str(BENCH))
    try:
        import parity_refs

        yield parity_refs
    finally:
        sys.path.remove(str(BENCH))


def _git(*argv, cwd):
    return subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_is_read_through_git_packed_refs_included(refs, tmp_path):
    repo = tmp_path / "my refs" / "ref"  # a path with a space: one line of git's answer
    repo.mkdir(parents=True)
    (repo / "a.py").write_text("x = 1\n")
    _git("init", "-q", cwd=repo)
    _git("add", "-A", cwd=repo)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x", cwd=repo)
    head = _git("rev-parse", "HEAD", cwd=repo)
    assert refs._commit(repo) == head
    _git("pack-refs", "--all", cwd=repo)  # as `git gc` does: it recorded "ref: refs/heads/master"
    assert refs._commit(repo) == head
    # a folder inside a repository is not that repository's checkout: no commit borrowed from it
    (repo / "sub").mkdir()
    assert refs._commit(repo / "sub") == "unknown"
    (repo / "sub" / "COMMIT").write_text("abc123\n")
    assert refs._commit(repo / "sub") == "abc123"


def test_a_checkout_of_another_revision_is_refused_naming_the_tested_commit(refs, tmp_path, monkeypatch):
    marker = tmp_path / "recpre" / "model_dynamic.py"
    marker.parent.mkdir(parents=True)
    marker.write_text("")

    def renamed_config(*_a, **_k):
        raise ValueError("'nebel-raven-3.5b' is not a supported config name")

    monkeypatch.setitem(refs.REFERENCES, "huginn", renamed_config)
    with pytest.raises(SystemExit, match=r"cannot be configured as the harness does \(ValueError: 'nebel-raven"
                                         r".*commit 59e0b69b"):
        refs.load_reference("huginn", tmp_path, None, 0)


def test_bench_vs_refs_names_its_own_option_for_an_incomplete_checkout(tmp_path):
    marker = tmp_path / "huginn" / "recpre" / "model_dynamic.py"  # the marker alone: its imports are missing
    marker.parent.mkdir(parents=True)
    marker.write_text("from recpre.nowhere import thing\n")
    proc = _run(tmp_path, "bench_vs_refs.py", "--huginn", str(tmp_path / "huginn"), "--hidden", "64", "--heads", "4",
                "--seq", "16", "--batch", "1", "--reps", "1")
    _refused(proc, "bench_vs_refs.py", f"--huginn: {tmp_path / 'huginn'}: the huginn reference cannot be imported")


def test_a_checkout_at_another_commit_is_named(refs, tmp_path, monkeypatch, capsys):
    """A checkout of another revision that the harness can configure was accepted without a word."""
    marker = tmp_path / "recpre" / "model_dynamic.py"
    marker.parent.mkdir(parents=True)
    marker.write_text("")

    class Fake:
        def __init__(self, root, shape, seed):
            self.commit = commit

    monkeypatch.setitem(refs.REFERENCES, "huginn", Fake)
    for commit, words in (("ebe6645" + "0" * 33, "is at commit ebe664500000; the README's huginn results come from "
                                                 "59e0b69b"),
                          ("unknown", "its commit is unknown"), ("59e0b69b" + "1" * 32, None), ("59e0b69", None),
                          ("", "is at commit ; the README"), ("5", "is at commit 5; the README")):
        refs.load_reference("huginn", tmp_path, None, 0)
        err = capsys.readouterr().err
        assert (words in err) if words else err == "", (commit, err)
