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


def test_a_rerun_into_an_earlier_result_is_refused_and_leaves_it(tmp_path: Path, capsys, monkeypatch) -> None:
    """A reference run replaced ``OUT/<label>.json`` without a word (megaloop runs were refused by
    their checkpoints only); and a reference refused after megaloop's loaders were set up left
    ``OUT/run_<label>/`` behind (they are set up in a temporary folder now)."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "huginn.json").write_text('{"losses": [1.0]}')
    monkeypatch.setattr(sys, "argv", ["parity.py", "--system", "huginn", "--ref-path", str(tmp_path), "--steps", "3",
                                      "--out", str(out)])
    monkeypatch.setattr("parity_refs.reference_root", lambda name, path: Path(path))
    assert parity._cli() == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"parity.py: error: {out / 'huginn.json'} holds an earlier result of label 'huginn': choose "
                   "another --label or remove that file (nothing was changed)"), err
    assert (out / "huginn.json").read_text() == '{"losses": [1.0]}'

    def refused(*_a, **_k):
        raise SystemExit("--ref-path: the huginn reference cannot be imported")

    monkeypatch.setattr("parity_refs.load_reference", refused)
    monkeypatch.setattr(sys, "argv", ["parity.py", "--system", "huginn", "--ref-path", str(tmp_path), "--steps", "3",
                                      "--label", "fresh", "--out", str(out)])
    assert parity._cli() == 2
    assert "cannot be imported" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["huginn.json"]  # no run_fresh/ left


def test_a_megaloop_run_records_its_final_depth_prior(tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert parity.main(["--system", "megaloop", "--label", "p", "--steps", "2", "--batch", "4", "--micro-batch", "2",
                        "--depths", "1", "--zero-init-depths", "1", "--trace-depth", "2", "--trace-seqs", "2",
                        "--out", str(out), "depth.kind=learned", "depth.target_mean=5", "depth.r_max=64"]) == 0
    prior = json.loads((out / "p.json").read_text())["depth_prior_final"]
    assert len(prior["probs"]) == 64 and abs(sum(prior["probs"]) - 1) < 1e-6 and 4 < prior["mean_depth"] < 6
