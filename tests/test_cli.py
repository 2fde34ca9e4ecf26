"""`megaloop` command line: overrides anywhere on the line, paper arms, errors exit 2."""

import pytest

from megaloop.cli import main, parse_args


def test_overrides_may_come_before_and_after_options():
    args = parse_args(["train", "train.max_steps=3", "--run-dir", "runs/x", "model.bptt_window=2",
                       "--arm", "pln5", "depth.cap=32"])
    assert args.run_dir == "runs/x" and args.arm == "pln5"
    assert args.overrides == ["train.max_steps=3", "model.bptt_window=2", "depth.cap=32"]


def test_unknown_arguments_still_fail():
    with pytest.raises(SystemExit) as err:
        parse_args(["train", "--run-dir", "x", "--no-such-flag"])
    assert err.value.code == 2
    with pytest.raises(SystemExit):  # only `train` takes dotlist overrides
        parse_args(["eval", "ppl", "--checkpoint", "x", "a=1"])


def test_unknown_arm_exits_2_naming_it(capsys, monkeypatch):
    import megaloop.runtime.parallel as parallel

    monkeypatch.setattr(parallel, "destroy_distributed", lambda: None)  # keep the session's world for later tests
    with pytest.raises(SystemExit) as err:
        main(["train", "--arm", "no_such_arm", "--run-dir", "unused"])
    assert err.value.code == 2
    assert "--arm 'no_such_arm'" in capsys.readouterr().err


@pytest.mark.parametrize("verb, hint", [("rl", " (continue from its last checkpoint with --resume)"), ("plan", "")])
def test_ctrl_c_in_a_delegated_verb_is_one_line_and_130(capsys, monkeypatch, tmp_path, verb, hint):
    # rl, distill-prefill, plan, convert, ... run their own parsers: Ctrl-C there is no traceback either,
    # and the status a launcher reads (MEGALOOP_EXIT_STATUS_FILE) is 130
    import importlib

    from megaloop.cli import DELEGATED

    def interrupted(_argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(DELEGATED[verb][0]), "main", interrupted)
    monkeypatch.setenv("MEGALOOP_EXIT_STATUS_FILE", str(tmp_path / "status"))
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exc:
        main([verb, "--help"])
    assert exc.value.code == 130
    assert capsys.readouterr().err == f"megaloop {verb}: interrupted{hint}\n"
    assert (tmp_path / "status").read_text() == "130\n"


def test_cli_start_silences_deepspeeds_device_probe_on_a_cpu_machine():
    """transformers (convert's reload check) and lm-eval import DeepSpeed, which warned "Setting accelerator
    to CPU" on every command; the CLI names the device it would settle on (only where torch sees no GPU)."""
    import os
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("the CLI leaves the probe alone where a GPU is visible")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    code = "from megaloop.cli import _quiet; import deepspeed; print('DS', deepspeed.accelerator.get_accelerator()._name)"
    bare = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    quiet = subprocess.run([sys.executable, "-c", code.replace("import deepspeed", "_quiet(); import deepspeed")],
                           capture_output=True, text=True, env=env, timeout=300)
    assert "DS cpu" in bare.stdout and "Setting accelerator" in bare.stdout + bare.stderr, bare.stderr[-2000:]
    assert "DS cpu" in quiet.stdout and "Setting accelerator" not in quiet.stdout + quiet.stderr, quiet.stderr[-2000:]


def test_the_deepspeed_launchers_local_rank_before_the_subcommand_is_dropped(monkeypatch):
    """`deepspeed --module megaloop.cli rl ...` runs `python -m megaloop.cli --local_rank=0 rl ...`."""
    from megaloop.cli import _strip_local_rank

    monkeypatch.setenv("LOCAL_RANK", "0")  # recorded, so the teardown removes what the call sets below
    monkeypatch.delenv("LOCAL_RANK")
    assert _strip_local_rank(["--local_rank=1", "rl", "--steps", "3"]) == ["rl", "--steps", "3"]
    import os

    assert os.environ["LOCAL_RANK"] == "1"
    assert _strip_local_rank(["--local-rank", "0", "distill-prefill"]) == ["distill-prefill"]
    assert _strip_local_rank(["rl", "--local_rank=0"]) == ["rl", "--local_rank=0"]  # the subcommand's own parser


def test_train_refuses_a_hand_written_config_that_is_the_runs_own_config_yaml(tmp_path, capsys, monkeypatch):
    """train rewrote the --config file it read when that was RUN_DIR/config.yaml: a hand-written file
    lost its comments and base:, and took this command's overrides (a later --resume then stopped)."""
    import megaloop.runtime.parallel as parallel
    from megaloop.config import load_config, resolve_config_path

    monkeypatch.setattr(parallel, "destroy_distributed", lambda: None)
    run = tmp_path / "run"
    run.mkdir()
    own = run / "config.yaml"
    text = f"# my experiment\nbase: {resolve_config_path('tiny')}\ntrain:\n  max_steps: 12\n"
    own.write_text(text)
    with pytest.raises(SystemExit) as err:
        main(["train", "--config", str(own), "--run-dir", str(run), "train.stop_after=2"])
    assert err.value.code == 2
    assert f"--config {own}: this is the run's own config.yaml, which train rewrites" in capsys.readouterr().err
    assert own.read_text() == text and sorted(p.name for p in run.iterdir()) == ["config.yaml"]
    # a saved config as megaloop writes it may be read in place (train writes what it holds); other paths pass
    from megaloop.cli import check_config_not_run_file

    load_config("tiny").dump(own)
    check_config_not_run_file(str(own), str(run))
    check_config_not_run_file(str(own), str(tmp_path / "elsewhere"))
    check_config_not_run_file("tiny", str(run))
