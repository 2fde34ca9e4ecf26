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


def _metrics(run: Path, steps: range, torn_at: int | None = None) -> Path:
    p = pln_probs(5.0, 0.5, 16).tolist()
    run.mkdir(parents=True, exist_ok=True)
    with (run / "metrics.jsonl").open("a") as f:
        for step in steps:
            f.write(json.dumps({"step": step, "prior_probs": p}) + "\n")
            if step == torn_at:
                f.write('{"step": 99, "prior_pro\n')  # a killed run's torn line, then the resumed run's
    return run / "metrics.jsonl"


def test_plot_prior_reads_a_resumed_run_once_per_step(tmp_path: Path) -> None:
    tool = _load_tool()
    log = _metrics(tmp_path / "run", range(1, 31), torn_at=30)
    _metrics(tmp_path / "run", range(21, 31))  # resumed from step 20: steps 21-30 again
    rows = tool.load_prior_rows(log)
    assert [r["step"] for r in rows] == list(range(1, 31))
    out = tmp_path / "fig.pdf"
    assert tool.main(["--metrics", str(log), "--out", str(out)]) == 0
    assert out.read_bytes()[:5] == b"%PDF-"  # the suffix's format, not a PNG named .pdf


def test_plot_prior_refuses_outputs_it_must_not_write(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tool = _load_tool()
    log = _metrics(tmp_path / "run", range(1, 6))
    before = log.read_bytes()
    (tmp_path / "afile").write_text("x")
    cases = {str(log): "is one of the run's own files",  # the run's log, overwritten by a figure before
             str(tmp_path / "run" / "checkpoints" / "p.png"): "is one of the run's own files",
             str(tmp_path / "afile" / "p.png"): "is a file, so the path cannot be created",
             str(tmp_path / "p.jpgx"): "the suffix must be one of .png, .pdf, .svg",
             str(tmp_path / "run"): "the suffix must be one of"}
    for out, why in cases.items():
        assert tool.main(["--metrics", str(tmp_path / "run"), "--out", out]) == 2, out
        err = capsys.readouterr().err
        assert err.startswith("plot_prior: error: --out") and why in err, err
    assert log.read_bytes() == before
    for bad in ("0", "-3", "x"):
        with pytest.raises(SystemExit) as stop:
            tool.main(["--metrics", str(log), "--out", str(tmp_path / "p.png"), "--max-depth", bad])
        assert stop.value.code == 2 and "--max-depth" in capsys.readouterr().err
    assert not list(tmp_path.glob(".p.tmp-*"))


def test_heatmap_columns_sit_on_their_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unevenly logged steps (log_interval, a resume) were drawn as uniform columns from the first to the
    last step, so a column drifted off its step (step 12 over 10.4-12.3 in a run logged at 3, 6, 8, 9, 12)."""
    import matplotlib.axes

    tool = _load_tool()
    seen = []
    real = matplotlib.axes.Axes.pcolormesh

    def spy(self, *args, **kw):
        if len(args) == 3 and getattr(args[0], "ndim", 2) == 1:  # the heatmap (the colorbar's mesh is 2-D)
            seen.append((list(args[0]), list(args[1]), args[2].shape))
        return real(self, *args, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "pcolormesh", spy)
    p = pln_probs(5.0, 0.5, 8).tolist()
    for steps, edges in (([3, 6, 8, 9, 12], [1.5, 4.5, 7.0, 8.5, 10.5, 13.5]), ([7], [6.5, 7.5])):
        log = tmp_path / f"m{len(steps)}.jsonl"
        log.write_text("".join(json.dumps({"step": s, "prior_probs": p}) + "\n" for s in steps))
        assert tool.main(["--metrics", str(log), "--out", str(tmp_path / f"p{len(steps)}.png")]) == 0
        x, y, shape = seen[-1]
        assert x == pytest.approx(edges) and y == pytest.approx([r + 0.5 for r in range(9)]) and shape == (8, len(steps))


def test_a_run_of_one_logged_step_draws_its_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A line through one point draws nothing: a 1-step run's mean depth and entropy were invisible."""
    import matplotlib.axes

    tool = _load_tool()
    markers = []
    real = matplotlib.axes.Axes.plot

    def spy(self, *args, **kw):
        markers.append(kw.get("marker"))
        return real(self, *args, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    for steps, want in (([1], "o"), ([1, 2], None)):
        log = _metrics(tmp_path / f"run{len(steps)}", range(1, len(steps) + 1))
        markers.clear()
        assert tool.main(["--metrics", str(log), "--out", str(tmp_path / f"p{len(steps)}.png")]) == 0
        assert markers == [want] * 3, markers
