"""Signals before a command's own handling starts (megaloop/cli.py::main): Ctrl-C while torch and the
parsers load gives one line and exit 130 (no traceback) in every verb; SIGTERM/SIGUSR1 during a
training verb's set-up, before its first step, give one line and exit 75 (requeue: nothing was
checkpointed, ``--resume auto`` continues from the last checkpoint), also through
``MEGALOOP_EXIT_STATUS_FILE``; other verbs keep the default action of SIGTERM.

Each case runs ``megaloop.cli.main`` in a fresh interpreter that sends itself the real signal at a
chosen point (``os.kill``), so the result does not depend on timing."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, clean_env

# where the process signals itself: in the imports (megaloop.cli._quiet) or once the trainer is built
AT_IMPORT = "megaloop.cli._quiet = (lambda q: lambda: (q(), signal.raise_signal(SIG)))(megaloop.cli._quiet)"
AT_TRAINER = textwrap.dedent("""
    import megaloop.train.trainer as tr
    _init = tr.Trainer.__init__
    def _init_then_signal(self, *a, **k):
        _init(self, *a, **k)
        signal.raise_signal(SIG)
    tr.Trainer.__init__ = _init_then_signal
""")


def _run(tmp_path, sig: int, hook: str, argv: list[str]) -> tuple[int, str, str]:
    status = tmp_path / "exit_status"
    # Ctrl-C as a terminal delivers it: a shell's background job (CI launched with `&`) starts with
    # SIGINT ignored, and Python then raises no KeyboardInterrupt
    code = "\n".join(["import os, signal, sys", "signal.signal(signal.SIGINT, signal.default_int_handler)",
                      "import megaloop.cli", f"SIG = {int(sig)}", hook,
                      f"megaloop.cli.main({argv!r})"])
    env = {**clean_env(), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "WANDB_MODE": "offline",
           "MEGALOOP_EXIT_STATUS_FILE": str(status)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    return proc.returncode, proc.stderr, status.read_text().strip() if status.exists() else ""


def _train(tmp_path) -> list[str]:
    return ["train", "--config", "tiny", "--run-dir", str(tmp_path / "run"), "train.max_steps=20"]


def test_ctrl_c_while_loading_is_one_line_in_every_verb(tmp_path):
    for argv in (_train(tmp_path), ["plan", "--config", "tiny", "--gpus", "1"], ["eval", "ppl", "--help"]):
        rc, err, status = _run(tmp_path, signal.SIGINT, AT_IMPORT, argv)
        assert rc == 130 and status == "130", (argv, rc, err)
        assert "Traceback" not in err and err.strip().count("\n") == 0, err
        assert "interrupted" in err
    assert not (tmp_path / "run").exists()


# while megaloop.cli imports the trainer module (megatron): the signal landed in `except
# NonFiniteLossError` with the name still unbound (UnboundLocalError, exit 1, no status file)
AT_TRAINER_IMPORT = textwrap.dedent("""
    class _SignalOnImport:
        def find_spec(self, name, path=None, target=None):
            if name == "megaloop.train.trainer":
                sys.meta_path.remove(self)
                signal.raise_signal(SIG)
            return None
    sys.meta_path.insert(0, _SignalOnImport())
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_during_set_up_exits_for_a_requeue(tmp_path, sig):
    for hook in (AT_IMPORT, AT_TRAINER_IMPORT, AT_TRAINER):
        rc, err, status = _run(tmp_path, sig, hook, _train(tmp_path))
        assert rc == 75 and status == "75", (hook, rc, err)
        assert "Traceback" not in err
        assert (f"megaloop train: stopped by {sig.name} during set-up, before the first step (no checkpoint "
                "written by this stop; --resume auto continues from the last one, if there is one)") in err
        assert not list((tmp_path / "run").glob("checkpoints/step_*"))


def test_a_sigterm_outside_a_sweeps_runs_is_one_line_and_130(tmp_path):
    """lr-screen / reproduce exited 143 without a word on a SIGTERM in set-up (README: 130 on Ctrl-C or
    SIGTERM); the signal now lands while the screen is being built, and nothing is written."""
    hook = textwrap.dedent("""
        import megaloop.screen.cli as sc, megaloop.repro.cli as rc
        def _then_signal(f):
            def g(*a, **k):
                out = f(*a, **k)
                signal.raise_signal(SIG)
                return out
            return g
        sc.build_screen = _then_signal(sc.build_screen)
        rc.load_plan = _then_signal(rc.load_plan)
    """)
    for verb, argv in (("lr-screen", ["lr-screen", "--config", "tiny", "--grid", "1e-3,2e-3,4e-3", "--stop-after", "2",
                                      "--out", str(tmp_path / "scr")]),
                       ("reproduce", ["reproduce", "--experiment", "tbptt", "--arms", "huginn_bR", "--out",
                                      str(tmp_path / "rep")])):
        rc, err, status = _run(tmp_path, signal.SIGTERM, hook, argv)
        assert rc == 130 and status == "130", (verb, rc, err)
        assert "Traceback" not in err and err.strip().count("\n") == 0, err
        assert f"megaloop {verb}: stopped by SIGTERM outside its local runs" in err, err
    assert not (tmp_path / "scr").exists() and not (tmp_path / "rep").exists()


def test_the_evaluation_child_of_a_sweep_says_what_it_is(capsys):
    """reproduce's pool stops its --evaluate-arm child with SIGTERM: its after.log said "outside its local
    runs ... submitted slurm jobs keep running", words for the sweep itself."""
    from megaloop.runtime.setup_stop import stopped_line

    assert stopped_line("reproduce", signal.SIGTERM, ["reproduce", "--evaluate-arm", "a", "--out", "o"]) == 130
    err = capsys.readouterr().err
    assert err.startswith("megaloop reproduce --evaluate-arm: stopped by SIGTERM") and "slurm" not in err, err


def test_other_verbs_keep_the_default_sigterm(tmp_path):
    rc, err, _ = _run(tmp_path, signal.SIGTERM, AT_IMPORT, ["plan", "--config", "tiny", "--gpus", "1"])
    assert rc == -signal.SIGTERM, (rc, err)


def test_after_the_loop_a_stop_signal_has_its_default_action_again(tmp_path):
    """SignalStop put the set-up handler back after the last step: a SIGTERM while wandb finished or
    the run's lock was released was reported as a stop in set-up and exited 75 (a requeue of a
    finished run). It ends the process as before now (143), after the run completed."""
    hook = textwrap.dedent("""
        import megaloop.train.trainer as tr
        _close = tr.Trainer.close
        def _close_then_signal(self, *a, **k):
            signal.raise_signal(SIG)
            return _close(self, *a, **k)
        tr.Trainer.close = _close_then_signal
    """)
    rc, err, status = _run(tmp_path, signal.SIGTERM, hook, _train(tmp_path)[:-1] + ["train.max_steps=12",
                                                                                     "optim.warmup_steps=1"])
    assert rc == -signal.SIGTERM, (rc, err[-2000:])
    assert "during set-up" not in err
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_00000012"


def test_in_process_callers_get_their_handlers_back_and_threads_install_none():
    import threading

    from megaloop.cli import main

    mine = lambda *_: None  # noqa: E731
    old = signal.signal(signal.SIGTERM, mine)
    try:
        for argv in (["convert", "--bogus"], ["train", "--help"]):
            with pytest.raises(SystemExit):
                main(argv)
            assert signal.getsignal(signal.SIGTERM) is mine, argv
        errors = []

        def worker():
            try:
                main(["convert", "--help"])
            except SystemExit:
                pass
            except Exception as err:  # noqa: BLE001 - what the test looks for
                errors.append(err)

        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert errors == []  # ValueError: signal only works in main thread
    finally:
        signal.signal(signal.SIGTERM, old)
