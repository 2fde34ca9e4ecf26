"""The parity harness's argument checks and recorded command (tools/bench/parity_args.py): options that
failed only after the whole training run are refused first; --ref-path is masked argument by argument."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "tools" / "bench"))
import parity  # noqa: E402
from parity_args import masked_command  # noqa: E402


@pytest.mark.parametrize("argv,words", [
    (["--trace-depth", "0"], "--trace-depth: must be >= 1, got 0"),
    (["--depths", "-1", "5"], "--depths: depths are >= 1, got [-1]"),
    (["--depths", "0"], "--depths: depths are >= 1, got [0]"),
    (["--steps", "0"], "--steps: must be >= 2 (the warm-up's step must end before the schedule's horizon), got 0"),
    (["--steps", "1"], "--steps: must be >= 2"),  # a ConfigError traceback after set-up
    (["--batch", "12", "--micro-batch", "8"], "--micro-batch: 8 does not divide --batch 12"),
    (["--lr", "-1"], "--lr: must be a number > 0, got -1.0"),
    (["--mean-depth", "0"], "--mean-depth: must be >= 1, got 0.0"),
    (["--threads", "0"], "--threads: must be >= 1, got 0"),
    (["--ref-path", "/tmp"], "--ref-path: --system megaloop trains no reference"),
    (["model.nonsense=1"], "override: model.nonsense: unknown field"),
    # at odds with the protocol's depth.cap=64: a ConfigError traceback once the run was set up
    (["depth.kind=learned", "depth.r_max=16"], "override: depth.cap: 64 is above depth.r_max=16"),
])
def test_bad_options_are_refused_before_training(tmp_path: Path, capsys, argv, words) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parity.main(["--system", "megaloop", "--steps", "3", "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and words in err, err
    assert not (tmp_path / "o").exists()


def test_an_out_that_is_a_file_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit):
        parity.main(["--system", "megaloop", "--out", str(tmp_path / "f")])
    assert "--out: " in capsys.readouterr().err


def test_the_recorded_command_masks_whole_arguments_only() -> None:
    """`--ref-path 2` turned `--steps 2` into `--steps REF_PATH`; `--ref-path /tmp` rewrote `--out /tmp/x`."""
    argv = ["--system", "parcae", "--ref-path", "/tmp", "--steps", "2", "--out", "/tmp/x", "--label", "a b"]
    assert masked_command(argv, REF_PATH="/tmp", MODEL=None) == (
        "python tools/bench/parity.py --system parcae --ref-path REF_PATH --steps 2 --out /tmp/x --label 'a b'")


def test_an_incomplete_reference_checkout_is_one_line_naming_it(tmp_path: Path) -> None:
    """A checkout holding the marker file but not the modules it imports raised ModuleNotFoundError.
    Run in a subprocess: loading a reference installs a triton stand-in and edits sys.path."""
    import subprocess

    root = tmp_path / "parcae"
    marker = root / "parcae_lm" / "models" / "parcae" / "parcae.py"
    marker.parent.mkdir(parents=True)
    marker.write_text("")  # config.py (imported first) is missing
    code = ("import sys; sys.path.insert(0, 'tools/bench'); from parity_refs import Shape, load_reference; "
            "load_reference('parcae', sys.argv[1], Shape(hidden=64, heads=4, ffn=128, n_prelude=1, n_core=1, "
            "n_coda=1, vocab=256, seq_len=16, mean_depth=2, bptt_window=2), 0)")
    proc = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    msg = proc.stderr.strip()
    assert msg.startswith(f"--ref-path: {root}: the parcae reference cannot be imported (ModuleNotFoundError"), msg
    assert "complete checkout" in msg and "\n" not in msg
