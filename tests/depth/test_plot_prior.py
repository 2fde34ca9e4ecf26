"""tools/plot_prior.py renders a PNG from a synthetic metrics.jsonl and fails clearly otherwise."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megaloop.depth.distributions import pln_probs

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "plot_prior.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("plot_prior_tool", _TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plot_prior_writes_png(tmp_path: Path) -> None:
    tool = _load_tool()
    p = pln_probs(5.0, 0.5, 64)
    with (tmp_path / "metrics.jsonl").open("w") as f:
        f.write(json.dumps({"step": 0, "loss": 3.0}) + "\n")  # rows without a prior are skipped
        for step in range(1, 30):
            q = (p * (1 + 0.02 * step * (p.new_tensor(range(64)) < 8))).tolist()
            s = sum(q)
            q = [v / s for v in q]
            f.write(json.dumps({"step": step, "prior_probs": q, "prior_mean_depth": 5.0, "prior_entropy": 2.3}) + "\n")
        f.write('{"step": 30, "prior_pro')  # truncated last line of a live run
    out = tmp_path / "fig" / "prior.png"
    assert tool.main(["--metrics", str(tmp_path / "metrics.jsonl"), "--out", str(out), "--log"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert tool.main(["--metrics", str(tmp_path), "--out", str(tmp_path / "b.png")]) == 0  # RUN_DIR also accepted


def test_plot_prior_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tool = _load_tool()
    assert tool.main(["--metrics", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "x.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    assert tool.main(["--metrics", str(tmp_path / "metrics.jsonl"), "--out", str(tmp_path / "x.png")]) == 2
    assert "prior_probs" in capsys.readouterr().err
