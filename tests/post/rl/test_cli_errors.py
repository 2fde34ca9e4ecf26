"""``megaloop rl`` / ``megaloop distill-prefill`` user errors: exit 2 with one line naming the
culprit, before anything is loaded or overwritten (issue #21, item 5); and a short ``rl`` run on
the code task records how completions were isolated."""

from __future__ import annotations

import json

import pytest

from megaloop.post.distill.cli import main as distill_main
from megaloop.post.rl.cli import main as rl_main
from tests.post.cli_helpers import fake_hf, one_error_line


def _bad_models(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("not a model")
    afile = tmp_path / "model.bin"
    afile.write_bytes(b"\0" * 16)
    return [(tmp_path / "missing", "no such file or directory"), (empty, "is an empty directory"),
            (junk, "neither an HF folder"), (afile, "is a file")]


@pytest.mark.parametrize("which", ["rl", "distill"])
def test_bad_model_path_exits_2_with_one_line(tmp_path, capsys, which):
    for path, msg in _bad_models(tmp_path):
        out = tmp_path / f"out-{path.name}"
        if which == "rl":
            rc = rl_main(["--model", str(path), "--out", str(out), "--task", "arithmetic", "--device", "cpu"])
            flag = "--model"
        else:
            rc = distill_main(["--teacher", str(path), "--out", str(out), "--device", "cpu"])
            flag = "--teacher"
        line = one_error_line(capsys)
        assert rc == 2 and f"{flag} {path}" in line and msg in line, line
        assert not out.exists()


def test_resume_without_checkpoint_exits_2(tmp_path, capsys):
    model = fake_hf(tmp_path / "m", weights=False)
    rc = rl_main(["--model", str(model), "--out", str(tmp_path / "o"), "--resume", "--device", "cpu"])
    line = one_error_line(capsys)
    assert rc == 2 and "--resume: no checkpoint in" in line and "NameError" not in line
    rc = distill_main(["--teacher", str(model), "--out", str(tmp_path / "d"), "--resume", "--device", "cpu"])
    line = one_error_line(capsys)
    assert rc == 2 and "--resume: no checkpoint in" in line and "NameError" not in line


@pytest.mark.parametrize("content,msg", [(b"", "the file is empty"), (b"  \n\n", "the file is empty"),
                                         (b"ok\n\xff\xfe\n", ":2: not UTF-8 text")])
def test_distill_bad_data_file_exits_2(tmp_path, capsys, content, msg):
    model = fake_hf(tmp_path / "m", weights=False)
    data = tmp_path / "data.txt"
    data.write_bytes(content)
    rc = distill_main(["--teacher", str(model), "--out", str(tmp_path / "d"), "--data", str(data), "--device", "cpu"])
    line = one_error_line(capsys)
    assert rc == 2 and f"--data {data}" in line and msg in line, line


@pytest.mark.parametrize("kind", ["mbpp", "exact"])
def test_non_utf8_task_file_exits_2_naming_it(tmp_path, capsys, kind):
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(b'{"prompt": "def f():\\n", "tests": ["assert f() == 1"], "answer": "1"}\n\xff\n')
    rc = rl_main(["--model", str(tmp_path / "unused"), "--out", str(tmp_path / "o"), "--task", f"{kind}:{path}"])
    line = one_error_line(capsys)
    assert rc == 2 and f"{path}:2: not UTF-8 text" in line, line


@pytest.mark.parametrize("which", ["rl", "distill"])
def test_rerun_into_existing_out_is_refused_and_keeps_metrics(tmp_path, capsys, which):
    model = fake_hf(tmp_path / "m", weights=False)
    out = tmp_path / "out"
    out.mkdir()
    old = ('{"step": 0, "reward_mean": 0.5}\n' if which == "rl"  # a run of the command's own
           else '{"step": 0, "loss": 1.0, "hidden": 0.5, "kl": 0.5}\n')
    (out / "metrics.jsonl").write_text(old)
    if which == "rl":
        rc = rl_main(["--model", str(model), "--out", str(out), "--device", "cpu"])
    else:
        rc = distill_main(["--teacher", str(model), "--out", str(out), "--device", "cpu"])
    line = one_error_line(capsys)
    assert rc == 2 and f"--out {out} already holds" in line and "--overwrite" in line, line
    assert (out / "metrics.jsonl").read_text() == old


def test_rl_on_code_task_records_isolation_and_overwrite(tiny_teacher, tmp_path, capsys):
    """``megaloop rl --task mbpp:tiny``: an untrained model's completions earn 0 (not 1 through any
    leftover from a previous sample), the isolation is in metrics.jsonl and megaloop_rl.json, and
    ``--overwrite`` replaces an earlier run."""
    from tests.post.rl.sandbox_checks import real_backend

    real_backend()
    _, hf_dir = tiny_teacher
    out = tmp_path / "rl"
    def argv(steps, *extra):
        return ["--model", str(hf_dir), "--out", str(out), "--task", "mbpp:tiny", "--steps", str(steps),
                "--group-size", "2", "--prompts", "1", "--max-new-tokens", "4", "--depth", "2",
                "--neumann-b", "2", "--device", "cpu", "--reward-workers", "2", *extra]

    assert rl_main(argv(2)) == 0
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_mean"] for r in recs] == [0.0, 0.0]
    assert all(r["reward_isolation"].startswith("bwrap") for r in recs)
    assert [r["reward_timeouts"] for r in recs] == [0, 0]
    summary = json.loads((out / "megaloop_rl.json").read_text())
    sandbox = summary["reward_sandbox"]
    assert sandbox["isolation"].startswith("bwrap") and sandbox["unsafe_code_exec"] is False
    assert sandbox["workers"] == 2
    capsys.readouterr()
    assert rl_main(argv(2)) == 2 and "already holds" in one_error_line(capsys)
    assert rl_main(argv(1, "--overwrite")) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_rl_reports_completions_killed_at_the_wall_limit(tiny_teacher, tmp_path, capsys):
    """A run killed at the sandbox's wall-clock limit scores 0 whatever the code: with more --reward-workers
    on a loaded host a correct program did, and nothing said so. Counted per step and warned once."""
    from tests.post.rl.sandbox_checks import real_backend

    real_backend()
    _, hf_dir = tiny_teacher
    task = tmp_path / "slow.jsonl"
    task.write_text(json.dumps({"prompt": "import time\ntime.sleep(60)\ndef f():\n    return 1\n#",
                                "tests": ["assert f() == 1"]}) + "\n")
    assert rl_main(["--model", str(hf_dir), "--out", str(tmp_path / "rl"), "--task", f"mbpp:{task}", "--steps", "1",
                    "--group-size", "2", "--prompts", "1", "--max-new-tokens", "1", "--depth", "2",
                    "--neumann-b", "2", "--device", "cpu", "--reward-workers", "2"]) == 0
    (rec,) = [json.loads(l) for l in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert rec["reward_mean"] == 0.0 and rec["reward_timeouts"] == 2, rec
    out = capsys.readouterr().out
    assert "warning: 2 of 2 sandboxed runs at step 0 were killed at the 5.0 s wall-clock limit" in out, out


def test_rl_without_sandbox_refuses_in_one_line(tmp_path, capsys, monkeypatch):
    from megaloop.post.rl import sandbox as sb

    monkeypatch.setenv("MEGALOOP_BWRAP", str(tmp_path / "no-bwrap"))
    monkeypatch.setattr(sb, "_BACKEND", {})
    rc = rl_main(["--model", str(fake_hf(tmp_path / "m", weights=False)), "--out", str(tmp_path / "o"), "--task", "mbpp:tiny"])
    line = one_error_line(capsys)
    assert rc == 2 and "no working sandbox" in line and "--unsafe-code-exec" in line, line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("extra", [["--reward-workers", "8"], ["--reward-mode", "fraction"], ["--unsafe-code-exec"],
                                   ["--reward-workers", "4", "--reward-mode", "all"]])
def test_reward_options_of_a_task_that_runs_no_code_are_refused(tmp_path, capsys, extra):
    """They configure the mbpp sandbox only and were ignored silently by the other tasks."""
    model = fake_hf(tmp_path / "m", weights=False)
    rc = rl_main(["--model", str(model), "--out", str(tmp_path / "o"), "--task", "arithmetic", "--device", "cpu",
                  *extra])
    line = one_error_line(capsys)
    assert rc == 2 and line.startswith(f"megaloop rl: error: {extra[0]}") and "--task arithmetic runs no code" in line, line
    assert not (tmp_path / "o").exists()
