"""The console sink of megaloop/train/metrics.py: the progress bar only where rich draws it (standard
output is a terminal), else one line per logged step, with the validation CE at evaluation steps."""

from __future__ import annotations

import io

from megaloop.config import LoggingConfig
from megaloop.train.metrics import MetricsLogger


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def _log(tmp_path, monkeypatch, *, out_tty: bool, err_tty: bool) -> tuple[MetricsLogger, _Stream]:
    out, err = _Stream(out_tty), _Stream(err_tty)
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    log = MetricsLogger(tmp_path, LoggingConfig(progress=True), enabled=True, total_steps=4, start_step=0,
                        config_dict={})
    log.log({"step": 1, "loss": 8.25, "lr": 1e-3, "grad_norm": 2.0})
    log.log({"step": 2, "loss": 7.5, "lr": 2e-3, "grad_norm": 1.5, "val_ce": 7.125, "val_ppl": 1243.0})
    log.close()
    return log, out


def test_stdout_redirected_from_a_terminal_gets_one_line_per_step(tmp_path, monkeypatch):
    """`megaloop train ... > train.log` from a shell: stderr is still the terminal. The bar was
    chosen (rich draws it on stdout, which is no terminal: nothing animates) and the file got no
    step line."""
    log, out = _log(tmp_path, monkeypatch, out_tty=False, err_tty=True)
    assert log._progress is None
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step      1 loss=8.25 lr=0.001 grad_norm=2"), lines
    assert lines[1].startswith("step      2 loss=7.5") and lines[1].endswith("val_ce=7.125"), lines


def test_the_bar_is_drawn_where_stdout_is_a_terminal(tmp_path, monkeypatch):
    log, out = _log(tmp_path, monkeypatch, out_tty=True, err_tty=False)  # 2> err.log: the bar stays
    assert log._progress is not None and "step      1" not in out.getvalue()
