"""tools/bench/parity.py end to end on megaloop (a few steps): it trains, evaluates and writes its
result. A trainer change (``_val_plan`` became a property) broke it after training, untested."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "tools" / "bench"))
import parity  # noqa: E402


def test_a_megaloop_run_writes_its_result(tmp_path: Path, capsys) -> None:
    out = tmp_path / "o"
    code = parity.main(["--system", "megaloop", "--label", "t", "--steps", "2", "--batch", "4", "--micro-batch", "2",
                        "--depths", "1", "2", "--zero-init-depths", "1", "--trace-depth", "2", "--trace-seqs", "2",
                        "--out", str(out)])
    assert code == 0
    res = json.loads((out / "t.json").read_text())
    assert len(res["losses"]) == 2 and set(res["val_ppl"]) == {"1", "2"}
    assert all(v > 1 for v in res["val_ppl"].values())
    assert "--system megaloop --label t --steps 2" in res["command"]
    assert "t: train loss (last 10)" in capsys.readouterr().out


def test_a_late_refusal_is_one_line_and_exit_2(tmp_path: Path, capsys, monkeypatch) -> None:
    """A reference checkout without its model file exited 1 (``SystemExit(message)``)."""
    monkeypatch.setattr(sys, "argv", ["parity.py", "--system", "huginn", "--ref-path", str(tmp_path), "--steps", "3",
                                      "--out", str(tmp_path / "o")])
    assert parity._cli() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"parity.py: error: --ref-path: {tmp_path} has no recpre/model_dynamic.py (pass the root of a "
                   "checkout of the huginn repository)"]
