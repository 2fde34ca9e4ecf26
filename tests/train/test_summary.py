"""tools/run_summary.py: run totals from the cumulative counters of metrics.jsonl."""

import json
import subprocess
import sys

from tests.conftest import ROOT


def _write(run, recs, tail=""):
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + tail)


def _rec(step, **kw):
    base = {"step": step, "loss": 5.0 - step, "tokens": 100 * step, "target_tokens_total": 99 * step,
            "model_flops_total": 1e9 * step, "depth_counts": {"2": step, "5": 2 * step},
            "prior_probs": [0.1, 0.2, 0.3, 0.2, 0.2], "prior_mean_depth": 3.2, "prior_entropy": 1.5}
    return {**base, **kw}


def _tool(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "run_summary.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT)


def test_summary_totals_best_and_last_val(tmp_path):
    run = tmp_path / "run"
    recs = [_rec(10, val_ce=3.0), _rec(20, val_ce=2.5, val_ce_per_source={"a": 2.4, "b": 2.6}),
            _rec(30, val_ce=2.7)]
    _write(run, recs, tail='{"step": 40, "lo')  # a last line cut by a kill is ignored
    proc = _tool(run, "--json", tmp_path / "s.json")
    assert proc.returncode == 0, proc.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["steps"] == 30 and s["model_flops"] == 3e10 and s["tokens"] == 3000
    assert s["depth_counts"] == {"2": 30, "5": 60} and s["microbatches"] == 90
    assert abs(s["mean_depth_drawn"] - 4.0) < 1e-12
    assert (s["best_val_ce"], s["best_val_step"], s["last_val_ce"]) == (2.5, 20, 2.7)
    assert s["val_ce_per_source"] == {"a": 2.4, "b": 2.6}
    assert s["prior"]["p5"] == 0.2
    assert proc.stdout.strip().splitlines()[-1].startswith("steps=30 tokens=3,000 model_flops=3e+10")


def test_resumed_duplicate_steps_take_the_later_record(tmp_path):
    run = tmp_path / "run"
    _write(run, [_rec(1), _rec(2, loss=9.0), _rec(2, loss=1.0)])
    from megaloop.train.summary import summarize

    assert summarize(run)["final_loss"] == 1.0


def test_bad_run_dirs_exit_2(tmp_path):
    proc = _tool(tmp_path / "nothing")
    assert proc.returncode == 2 and "no metrics.jsonl" in proc.stderr
    _write(tmp_path / "old", [{"step": 1, "loss": 2.0}])
    proc = _tool(tmp_path / "old")
    assert proc.returncode == 2 and "model_flops_total" in proc.stderr


def test_a_json_that_is_a_run_file_or_cannot_be_written_is_refused_first(tmp_path):
    """--json onto the run's metrics.jsonl used to replace the run's history with the summary; an
    --json in a missing folder or onto a directory printed the summary, then a traceback (exit 1)."""
    run = tmp_path / "run"
    _write(run, [_rec(10)])
    before = (run / "metrics.jsonl").read_text()
    for out, says in ((run / "metrics.jsonl", "is one of the run's own files"),
                      (run / "checkpoints" / "x.json", "is one of the run's own files"),
                      # the sweep commands' files in a run: its log and reproduce's evaluation record
                      (run / "train.log", "is one of the run's own files"),
                      (run / "eval" / "summary.json", "is one of the run's own files"),
                      (tmp_path, "is a directory, not a file path")):
        (run / "checkpoints").mkdir(exist_ok=True)
        proc = _tool(run, "--json", out)
        assert proc.returncode == 2 and says in proc.stderr and proc.stdout == "", (out, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert (run / "metrics.jsonl").read_text() == before
    # the run given as its metrics file (summarize reads either): its files were not protected, and
    # --json replaced the log, config.yaml or the checkpoints' pointer with the summary, exit 0
    (run / "config.yaml").write_text("model: {}\n")
    for out in (run / "metrics.jsonl", run / "config.yaml", run / "checkpoints" / "latest"):
        proc = _tool(run / "metrics.jsonl", "--json", out)
        assert proc.returncode == 2 and "is one of the run's own files" in proc.stderr, (out, proc.stderr)
    assert (run / "metrics.jsonl").read_text() == before and (run / "config.yaml").read_text() == "model: {}\n"
    proc = _tool(run, "--json", tmp_path / "new" / "deeper" / "s.json")  # a new folder is fine: created
    assert proc.returncode == 0 and (tmp_path / "new" / "deeper" / "s.json").is_file(), proc.stderr
    proc = _tool(run, "--json", run / "summary.json")
    assert proc.returncode == 0 and json.loads((run / "summary.json").read_text())["steps"] == 10, proc.stderr
    # checkpoints behind a link are still the run's; a link to a shared results file is written through
    (run / "checkpoints").rmdir()
    (tmp_path / "scratch" / "step_00000002").mkdir(parents=True)
    (run / "checkpoints").symlink_to(tmp_path / "scratch")
    proc = _tool(run, "--json", run / "checkpoints" / "step_00000002" / "megaloop.json")
    assert proc.returncode == 2 and "is one of the run's own files" in proc.stderr, proc.stderr
    (tmp_path / "shared.json").write_text("old")
    (tmp_path / "mine.json").symlink_to(tmp_path / "shared.json")
    assert _tool(run, "--json", tmp_path / "mine.json").returncode == 0
    assert (tmp_path / "mine.json").is_symlink() and json.loads((tmp_path / "shared.json").read_text())["steps"] == 10
    proc = subprocess.run(f"{sys.executable} {ROOT / 'tools' / 'run_summary.py'} {run} --json /dev/stdout | cat",
                          shell=True, capture_output=True, text=True)  # a pipe: written into, not replaced
    assert proc.returncode == 0 and proc.stdout.count('"steps": 10') == 2, proc.stdout + proc.stderr


def test_non_finite_values_and_a_run_that_ended_in_skipped_steps(tmp_path):
    """A diverged run (train.nonfinite=skip) wrote `NaN` into --json (not JSON), a NaN val CE could be
    the "best", a huge one printed ppl exp(50), and skipped steps (which log no prior) hid the prior."""
    run = tmp_path / "run"
    nan, inf = float("nan"), float("inf")
    skipped = {k: None for k in ("prior_probs", "prior_mean_depth", "prior_entropy")}
    recs = [_rec(2, val_ce=nan), _rec(10, val_ce=7.0), _rec(18, val_ce=6.5, prior_probs=[0.5, 0.5, 0, 0, 0]),
            {**_rec(19, loss=nan, val_ce=inf), **skipped}, {**_rec(20, loss=nan), **skipped}]
    _write(run, recs)
    proc = _tool(run, "--json", tmp_path / "s.json")
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "s.json").read_text()
    s = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))  # strict JSON
    assert s["final_loss"] is None and s["last_val_ce"] is None and s["last_val_step"] == 19
    assert (s["best_val_ce"], s["best_val_step"]) == (6.5, 18)
    assert s["prior"]["step"] == 18 and s["prior"]["probs"] == [0.5, 0.5, 0, 0, 0]
    line = proc.stdout.strip().splitlines()[-1]
    assert "val_ce=inf (ppl inf) best=6.5000@18" in line and "prior_mean=3.200" in line


def test_the_line_of_a_nan_validation_ce_says_nan():
    from megaloop.train.summary import one_line

    s = {"steps": 3, "tokens": 10, "model_flops": 1.0, "mean_depth_drawn": None, "last_val_ce": float("nan"),
         "best_val_ce": None, "best_val_step": None}
    assert one_line(s).endswith("val_ce=nan (ppl nan) best=-")
