"""Every command's ``main`` turns a :class:`megaloop.errors.UserError` (raised anywhere below it)
into one line on stderr naming the command, and exit status 2."""

from __future__ import annotations

import importlib

import pytest

from megaloop.errors import UserError

# (module whose attribute raises, attribute, entry module, argv after the verb)
COMMANDS = {
    "train": ("megaloop.cli", "cmd_train", "megaloop.cli", ["train"]),
    "eval": ("megaloop.eval.cli", "cmd_eval_ppl", "megaloop.cli", ["eval", "ppl", "--checkpoint", "x"]),
    "generate": ("megaloop.inference.generate_cli", "cmd_generate", "megaloop.cli",
                 ["generate", "--checkpoint", "x", "--prompt", "p"]),
    "rl": ("megaloop.post.rl.cli", "_run", "megaloop.post.rl.cli", ["--model", "m", "--out", "o"]),
    "rl grad-check": ("megaloop.post.rl.grad_check", "main", "megaloop.post.rl.cli", ["grad-check", "--model", "m"]),
    "distill-prefill": ("megaloop.post.distill.cli", "_run", "megaloop.post.distill.cli", ["--teacher", "t", "--out", "o"]),
    "plan": ("megaloop.plan.cli", "_run", "megaloop.plan.cli", []),
    "convert": ("megaloop.hf.convert", "convert_to_hf", "megaloop.hf.convert_cli", ["--checkpoint", "c", "--out", "o"]),
    "lr-screen": ("megaloop.screen.cli", "run_screen", "megaloop.screen.cli", ["--config", "tiny", "--out", "o"]),
    "reproduce": ("megaloop.repro.cli", "run_experiment", "megaloop.repro.cli", ["--experiment", "tbptt"]),
}
PREFIX = {"train": "megaloop", "eval": "megaloop", "generate": "megaloop", "rl grad-check": "megaloop rl"}


class Culprit(UserError):
    """A UserError subclass none of the commands knows by name."""


@pytest.mark.parametrize("name", list(COMMANDS))
def test_user_error_is_one_line_and_exit_2(name, monkeypatch, capsys):
    import megaloop.runtime.parallel as parallel

    where, attr, entry, argv = COMMANDS[name]

    def boom(*_a, **_k):
        raise Culprit("model.hidden_size: must be a multiple of model.num_heads\n(second line of detail)")

    monkeypatch.setattr(importlib.import_module(where), attr, boom)
    monkeypatch.setattr(parallel, "destroy_distributed", lambda: None)  # keep the session's world
    monkeypatch.delenv("RANK", raising=False)  # report() names the rank when there is one
    main = importlib.import_module(entry).main
    if entry == "megaloop.cli":
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        code = exit_info.value.code
    else:
        code = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    prog = PREFIX.get(name, f"megaloop {name}")
    assert err[0] == (f"{prog}: error: model.hidden_size: must be a multiple of model.num_heads; "
                      "(second line of detail)"), err


@pytest.mark.parametrize("argv", [
    ["train", "--config", "tiny", "--run-dir", ""],
    ["lr-screen", "--config", "tiny", "--out", "", "--dry-run"],
    ["reproduce", "--experiment", "tbptt", "--out", " ", "--dry-run"],
    ["rl", "--model", "m", "--out", ""],
    ["distill-prefill", "--teacher", "t", "--out", ""],
    ["convert", "--checkpoint", "c", "--out", ""],
    ["convert", "--checkpoint", "", "--out", "o"],  # an input: it meant the working directory
], ids=lambda a: a[0] + ("_input" if "" in a[:3] else ""))
def test_an_empty_output_folder_is_refused(argv, tmp_path, monkeypatch, capsys):
    """--run-dir "" (an unset $RUN_DIR) trained into the working directory; lr-screen --out "" wrote its
    points there; reproduce --out "" fell back on its default folder."""
    import megaloop.cli

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as code:
        megaloop.cli.main(argv)
    assert code.value.code == 2
    flag = "--run-dir" if argv[0] == "train" else "--checkpoint" if argv[2] == "" else "--out"
    assert f"argument {flag}: empty path (an unset shell variable?)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
