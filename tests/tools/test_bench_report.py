"""#8 acceptance: the README's benchmark table is what tools/bench/report.py renders from the JSON
results in the repo, and every result states its configuration, machine, date and command."""

import json
import sys

from tests.conftest import ROOT

BENCH = ROOT / "tools" / "bench"


def test_readme_table_is_rendered_from_the_results():
    sys.path.insert(0, str(BENCH))
    try:
        import report
    finally:
        sys.path.remove(str(BENCH))
    readme = (ROOT / "README.md").read_text()
    table = readme.split(report.BEGIN, 1)[1].split(report.END, 1)[0].strip()
    assert table == report.render().strip()


def test_every_result_states_configuration_machine_and_command():
    results = sorted((BENCH / "results").glob("*.json"))
    assert len(results) >= 8
    for path in results:
        d = json.loads(path.read_text())
        if path.stem == "gpu_check":  # tools/gpu_check.sh's summary has its own layout
            assert d["device_name"] and d["date"] and d["train"]
            continue
        assert d["config"] and d["machine"] and d["date"], path.name
        script = d["command"].split()[1]
        assert d["command"].startswith("python tools/bench/bench_") and (ROOT / script).is_file(), path.name


def test_a_result_its_row_cannot_table_is_one_line_naming_it(tmp_path, monkeypatch):
    """A result written with options its row does not expect (here: a loop-overhead run without the b=2
    ratio) raised a KeyError traceback from the rendering."""
    import pytest

    sys.path.insert(0, str(BENCH))
    try:
        import report
    finally:
        sys.path.remove(str(BENCH))
    (tmp_path / "results").mkdir()
    bad = tmp_path / "results" / "loop_overhead.json"
    bad.write_text(json.dumps({"benchmark": "loop_overhead", "config": {"hidden": 64, "seq": 16, "batch": 1},
                               "results": {"ratio_looped_b5_over_gpt12": 1.5}, "command": "python x.py --odd"}))
    monkeypatch.setattr(report, "HERE", tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        report.render()
    msg = str(exit_info.value.code)
    assert msg.startswith(f"report.py: {bad}: its row cannot be made (KeyError: 'ratio_looped_b2_over_gpt12')")
    assert "`python x.py --odd`" in msg
    bad.write_text("{")
    with pytest.raises(SystemExit, match="not valid JSON"):
        report.render()


def test_a_failed_gpu_check_is_marked_in_its_row(tmp_path, monkeypatch):
    """A failed GPU check's summary (ok: false) was tabled as a normal row of throughputs."""
    sys.path.insert(0, str(BENCH))
    try:
        import report
    finally:
        sys.path.remove(str(BENCH))
    summary = {"mode": "gpu", "ok": False, "problems": ["logits: fp32 max|d| 5.0e-01 exceeds the tolerance"],
               "device_name": "NVIDIA H200", "date": "2026-12-07T10:00:00",
               "train": {"bf16": {"config": "S", "median": {"tokens_per_s": 4305.0, "mfu": 0.058}}},
               "logits": {"fp32_max_abs_err": 0.5}}
    row = report._gpu_check_row(summary)[1]
    assert row.startswith("**check FAILED** (logits: fp32 max|d| 5.0e-01 exceeds the tolerance); S bf16: **4,305 tokens/s**")
    assert "FAILED" not in report._gpu_check_row({**summary, "ok": True, "problems": []})[1]
