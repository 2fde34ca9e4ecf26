"""`megaloop plan` flags: bad values and contradictions exit 2 with one line naming the flag
before any compute; --json-out is checked first and written atomically; --search holds the
layout flags given with it and says why nothing fits; --preflight --json is JSON; JSON units;
the vocabulary the data trains on; cluster descriptions; the tools/ wrappers on Ctrl-C."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

import megaloop.plan.search as plan_search
from megaloop.plan.cli import main as plan_main
from megaloop.plan.memory import GiB
from tests.conftest import ROOT


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = plan_main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def no_compute(monkeypatch):
    """Fail the test if a layout is evaluated or searched (errors must come before)."""
    def boom(*_a, **_k):
        raise AssertionError("computed before refusing")

    for name in ("evaluate", "search", "memory_plan"):
        monkeypatch.setattr(plan_search, name, boom)


def _one_error(err: str, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("megaloop plan: error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.mark.parametrize("argv,needles", [
    (["--steps", "-3"], ["--steps: must be >= 1, got -3"]),
    (["--steps", "0"], ["--steps: must be >= 1, got 0"]),
    (["--search", "--steps", "-1"], ["--steps: must be >= 1"]),
    (["--search", "--top", "-1"], ["--top: must be >= 1, got -1"]),
    (["--search", "--top", "0"], ["--top: must be >= 1, got 0"]),
    (["--top", "3"], ["--top: only applies to --search"]),
    (["--min-pp", "2"], ["--min-pp: only applies to --search"]),
    (["--search", "--pp", "1", "--min-pp", "2"], ["--min-pp", "--pp 1"]),
    (["--json-out", "/nonexistent/dir/x.json"], ["--json-out: folder /nonexistent/dir does not exist"]),
    (["--gpus", "8", "--nodes", "4"], ["--gpus: 8 GPUs contradict --nodes 4", "= 32"]),
    (["--preflight", "--search"], ["--preflight", "--search"]),
    (["--preflight", "--microbatch-sweep"], ["--preflight", "--microbatch-sweep"]),
    (["--preflight", "--steps", "4"], ["--preflight", "--steps"]),
    (["--search", "--microbatch-sweep"], ["--microbatch-sweep: sweeps one layout"]),
    (["--vocab", "100", "model.vocab_size=200"], ["--vocab: 100 contradicts", "model.vocab_size=200"]),
    # a layout flag against an override of its key: the flag won silently, in either order and with --search
    (["--tp", "2", "parallel.tp=4"], ["--tp: --tp 2 contradicts the override parallel.tp=4"]),
    (["parallel.tp=4", "--search", "--tp", "2"], ["--tp: --tp 2 contradicts the override parallel.tp=4"]),
    (["--mbs", "2", "train.micro_batch_size=8"], ["--mbs: --mbs 2 contradicts the override train.micro_batch_size=8"]),
    (["--no-sp", "parallel.sequence_parallel=true"], ["--sp: --no-sp contradicts", "sequence_parallel=true"]),
    # a world that spills over whole nodes unevenly: the header counted 3 nodes x 3 for 8 GPUs
    (["--gpus", "8", "cluster.gpus_per_node=3"], ["--gpus: 8 GPUs do not fill whole nodes of 3"]),
    (["--gpus", "10"], ["--gpus: 10 GPUs do not fill whole nodes of 8"]),
    (["--search", "--dp", "3"], ["--dp: 8 GPUs are not divisible by --dp 3"]),
    (["--search", "--tp", "2", "--pp", "8"], ["--search: 8 GPUs are not divisible by the held tp 2 x pp 8 = 16"]),
    (["--cluster", "/nonexistent.yaml"], ["--cluster: file /nonexistent.yaml does not exist"]),
    (["--cluster", ""], ["--cluster: empty"]),
    (["cluster.fragmentation=0.01"], ["cluster.fragmentation: must lie in [1, 2]", "got 0.01"]),
    (["cluster.fragmentation=5"], ["cluster.fragmentation"]),
    (["cluster.peak_fp8_tflops=500"], ["cluster.peak_fp8_tflops: 500 is below cluster.peak_bf16_tflops=989"]),
    (["cluster.reserved_gib=90"], ["cluster.reserved_gib"]),
])
def test_bad_flags_exit_2_before_compute(capsys, no_compute, argv, needles) -> None:
    code, out, err = _run(capsys, "--config", "S", "--gpus", "8", *argv) if "--gpus" not in argv \
        else _run(capsys, "--config", "S", *argv)
    assert code == 2 and not out
    _one_error(err, *needles)


def test_json_out_is_checked_first_and_written_atomically(capsys, tmp_path: Path, no_compute) -> None:
    code, _, err = _run(capsys, "--config", "S", "--gpus", "8", "--json-out", str(tmp_path))
    assert code == 2
    _one_error(err, "--json-out", "is a directory")


def test_json_out_never_replaces_an_input_or_another_file(capsys, tmp_path: Path, no_compute) -> None:
    """`--config my.yaml --json-out my.yaml` replaced the config with the report (and a metrics.jsonl went too)."""
    cfg = tmp_path / "my.yaml"
    cfg.write_text("model:\n  hidden_size: 128\n")
    code, _, err = _run(capsys, "--config", str(cfg), "--gpus", "8", "--json-out", str(cfg))
    assert code == 2
    _one_error(err, "--json-out", "is the --config file this command reads")
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n')
    code, _, err = _run(capsys, "--config", "S", "--gpus", "8", "--json-out", str(log))
    assert code == 2 and log.read_text() == '{"step": 1}\n{"step": 2}\n'
    _one_error(err, "--json-out", "is not a JSON report")
    cluster = tmp_path / "c.json"
    cluster.write_text('{"gpu_mem_gib": 80}')  # valid JSON, but the --cluster file itself
    code, _, err = _run(capsys, "--config", "S", "--gpus", "8", "--cluster", str(cluster), "--json-out", str(cluster))
    assert code == 2
    _one_error(err, "--json-out", "is the --cluster file this command reads")


def test_json_out_never_replaces_another_json_object(capsys, tmp_path: Path, no_compute) -> None:
    """Any file holding a JSON object was taken for an earlier report: a run's tokenizer.json, data.json or a
    checkpoint's megaloop.json was replaced by a plan report, exit 0."""
    for name, text in (("tokenizer.json", '{"version": "1.0", "model": {"type": "BPE"}}'),
                       ("megaloop.json", '{"step": 120, "format": 3}'), ("plan.json", '{"an": "earlier report"}')):
        f = tmp_path / name
        f.write_text(text)
        code, out, err = _run(capsys, "--config", "S", "--gpus", "8", "--json-out", str(f))
        assert code == 2 and not out and f.read_text() == text, name
        _one_error(err, "--json-out", "is not a JSON report")


@pytest.mark.parametrize("argv", [("--search", "--steps", "2"), ("--steps", "2"), ("--preflight",)])
def test_json_out_replaces_an_earlier_report_of_each_kind(capsys, tmp_path: Path, argv) -> None:
    """The three reports (--search, a plan, --preflight) are each recognised as an earlier report."""
    target = tmp_path / "plan.json"
    code, _, err = _run(capsys, "--config", "tiny", "--gpus", "2", "--json-out", str(target), *argv)
    assert code == 0, err
    first = target.read_text()
    code, _, err = _run(capsys, "--config", "tiny", "--gpus", "1", "--json-out", str(target), "--preflight")
    assert code == 0, err
    assert target.read_text() != first and json.loads(target.read_text())["preflight"] == "ok"


def test_json_out_replaces_the_file(capsys, tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    target.write_text('{"plans": [], "excluded": {}, "an": "earlier search report"}')
    code, out, _ = _run(capsys, "--config", "tiny", "--gpus", "1", "--steps", "2", "--json-out", str(target))
    assert code == 0 and out.startswith("megaloop plan: tiny")
    rep = json.loads(target.read_text())
    assert rep["layout_text"] == "TP1 PP1 DP1 mbs8" and rep["steps"]["step_s"]["n"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary left behind


def test_search_holds_the_layout_flags_given_with_it(capsys) -> None:
    code, out, _ = _run(capsys, "--config", "S", "--gpus", "8", "--search", "--tp", "8", "--pp", "1", "--recompute",
                        "--steps", "2", "--json")
    assert code == 0
    rep = json.loads(out)
    assert rep["held"] == {"tp": 8, "pp": 1, "recompute": True}
    assert rep["plans"] and all(p["layout"]["tp"] == 8 and p["layout"]["pp"] == 1 and p["layout"]["recompute"]
                                for p in rep["plans"])
    # a KEY=VALUE override of a searched key is held too
    code, out, _ = _run(capsys, "--config", "S", "--gpus", "8", "--search", "train.micro_batch_size=2", "--pp", "1",
                        "--steps", "2", "--json")
    assert code == 0 and {p["layout"]["micro_batch"] for p in json.loads(out)["plans"]} == {2}


def test_search_with_nothing_fitting_says_why_and_exits_2(capsys) -> None:
    code, out, err = _run(capsys, "--config", "S", "--gpus", "48", "--search")
    assert code == 2 and not out
    line = _one_error(err, "--search: no layout fits (48 x H100-SXM5-80GB)", "by the config's rules",
                      "train.global_batch_size: 328", "256 is not divisible")
    code, out, err = _run(capsys, "--config", "L", "--gpus", "8", "--search", "--mbs", "8", "--recompute",
                          "cluster.gpu_memory_gib=5", "--vocab", "65536")
    assert code == 2 and not out
    line = _one_error(err, "predicted not to fit in 5 GiB", "the smallest largest rank:", "held fixed: --mbs 8")
    assert "GiB)" in line


def test_preflight_json(capsys) -> None:
    code, out, err = _run(capsys, "--config", "S", "--gpus", "8", "--preflight", "--json")
    rep = json.loads(out)
    assert code == 0 and not err
    assert rep["preflight"] == "ok" and rep["fits"] is True and rep["line"].startswith("megaloop preflight: ok:")
    assert 0 < rep["largest_total_gib"] < rep["gpu_memory_gib"]
    code, out, err = _run(capsys, "--config", "L", "--gpus", "8", "--mbs", "64", "train.global_batch_size=1024",
                          "--preflight", "--json")
    rep = json.loads(out)
    assert code == 2 and rep["preflight"] == "refusing" and rep["largest_total_gib"] > rep["gpu_memory_gib"]


def test_preflight_auto_checks_the_overrides_first(capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out, err = _run(capsys, "--config", "S", "--gpus", "8", "--cluster", "auto", "--preflight", "cluster.nosuch=1")
    assert code == 2 and not out
    _one_error(err, "cluster.nosuch: unknown field")
    code, out, err = _run(capsys, "--config", "S", "--gpus", "8", "--nodes", "4", "--cluster", "auto", "--preflight")
    assert code == 2
    _one_error(err, "--gpus: 8 GPUs contradict --nodes 4")


def test_json_units(capsys) -> None:
    code, out, _ = _run(capsys, "--config", "S", "--gpus", "8", "--pp", "2", "--steps", "4", "--json")
    assert code == 0
    rep = json.loads(out)
    assert rep["sampled_peak_gib"]["n"] == 4  # a count, not divided by 2**30
    assert 1 < rep["sampled_peak_gib"]["max"] < rep["gpu_memory_gib"]
    for row in rep["memory_gib"]:
        assert 0 < row["total"] < rep["gpu_memory_gib"] and row["param_count"] > 1e6
        for d in row["per_microbatch"]:
            assert isinstance(d["stage"], int) and isinstance(d["worst_depth"], int) and d["worst_depth"] >= 1
            for key in ("window", "prelude_coda", "logits", "pipeline", "other", "no_grad_working_set"):
                assert 0 <= d[key] < rep["gpu_memory_gib"], (key, d[key])  # GiB, not bytes
    # the breakdown in GiB = the model's bytes / 2**30
    from megaloop.config import load_config
    from megaloop.plan.cluster import load_cluster
    from megaloop.plan.layout import make_layout

    cfg = load_config("S", ["parallel.pp=2"])
    plan = plan_search.memory_plan(cfg, make_layout(cfg, 8), load_cluster("h100"), rep["vocab"])
    assert rep["memory_gib"][0]["per_microbatch"][0]["window"] == pytest.approx(
        plan.memory[0]["per_microbatch"][0]["window"] / GiB)


def test_mfu_against_the_peak_of_the_precision_used(capsys) -> None:
    code, out, _ = _run(capsys, "--config", "S", "--gpus", "8", "--fp8", "hybrid", "--steps", "2", "--json")
    steps = json.loads(out)["steps"]
    assert code == 0 and steps["peak_precision"] == "fp8" and steps["peak_tflops"] == 1979
    e = steps["expected"]
    assert 0 < e["mfu"] < 1 and e["mfu_vs_bf16"] == pytest.approx(e["mfu"] * 1979 / 989)
    code, out, _ = _run(capsys, "--config", "S", "--gpus", "8", "--fp8", "hybrid", "--steps", "2")
    assert "of dense FP8 peak 1979 TFLOP/s (FP8 layout; against the bf16 peak" in out


# ----------------------------------------------------------------------------- vocabulary
def test_vocab_of_the_embedded_corpus(capsys) -> None:
    code, out, _ = _run(capsys, "--config", "tiny", "--gpus", "1", "--steps", "1", "--json")
    rep = json.loads(out)
    assert rep["vocab"] == 4096 and "embedded corpus" in rep["vocab_source"]
    code, out, _ = _run(capsys, "--config", "tiny", "--gpus", "1", "--steps", "1", "--vocab", "65536", "--json")
    assert json.loads(out)["vocab"] == 65536 and json.loads(out)["vocab_source"] == "--vocab"
    code, out, _ = _run(capsys, "--config", "tiny", "--gpus", "1", "--steps", "1")
    assert "vocab 4096 (data.path=default: the embedded corpus's tokenizer)" in out


def test_vocab_of_a_local_mds_folder(capsys, tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps({"vocab_size": 259, "seq_len": 128}))
    code, out, _ = _run(capsys, "--config", "synth", "--gpus", "1", "--steps", "1", f"data.path={tmp_path}", "--json")
    rep = json.loads(out)
    assert code == 0 and rep["vocab"] == 259 and str(tmp_path / "manifest.json") in rep["vocab_source"]
    code, out, _ = _run(capsys, "--config", "synth", "--gpus", "1", "--steps", "1", f"data.path={tmp_path / 'none'}",
                        "--json")
    rep = json.loads(out)
    assert rep["vocab"] == 65536 and "no " in rep["vocab_source"] and "--vocab" in rep["vocab_source"]


def test_a_model_vocab_below_the_datas_tokenizer_is_refused(capsys, tmp_path: Path, no_compute) -> None:
    """plan and --preflight accepted a vocabulary `megaloop train` refuses, and planned its memory."""
    code, _, err = _run(capsys, "--config", "tiny", "--gpus", "1", "--preflight", "model.vocab_size=1000")
    assert code == 2 and "model.vocab_size: 1000 is smaller than the tokenizer's 4096 (data.path=default" in err
    (tmp_path / "manifest.json").write_text(json.dumps({"vocab_size": 259, "seq_len": 128}))
    code, _, err = _run(capsys, "--config", "synth", "--gpus", "1", f"data.path={tmp_path}", "model.vocab_size=200")
    assert code == 2 and "model.vocab_size: 200 is smaller than the tokenizer's 259" in err


def test_the_header_gives_the_planned_laws_mean(capsys) -> None:
    """A uniform init was headed with depth.mean (5), which it does not use; its law's mean is 32.5."""
    code, out, _ = _run(capsys, "--config", "S", "--arm", "u64", "--gpus", "8", "--vocab", "65536", "--steps", "1")
    assert code == 0 and "initial law uniform (mean 32.5, r_max 64)" in out


# ----------------------------------------------------------------------------- cluster files
def test_cluster_edits_as_a_section_mapping(capsys) -> None:
    """`cluster={gpu_memory_gib: 94}` was refused as "cluster: unknown field"."""
    code, out, _ = _run(capsys, "--config", "tiny", "--gpus", "1", "--steps", "1", "--json",
                        "cluster={gpu_memory_gib: 94, gpus_per_node: 4}")
    assert code == 0 and json.loads(out)["gpu_memory_gib"] == 94.0
    code, out, _ = _run(capsys, "--config", "tiny", "--gpus", "1", "--steps", "1", "--json",
                        "cluster={peak_fp8_tflops: null}", "cluster={gpu_memory_gib: 94}", "cluster.gpu_memory_gib=80")
    assert code == 0 and json.loads(out)["gpu_memory_gib"] == 80.0  # null read as null; the last edit wins
    code, _, err = _run(capsys, "--config", "tiny", "--gpus", "1", "cluster=5")
    assert code == 2 and "cluster: expected a mapping such as cluster={gpu_memory_gib: 94}, got '5'" in err



def test_cluster_file_must_give_the_hardware(capsys, tmp_path: Path, no_compute) -> None:
    bad = tmp_path / "mine.yaml"
    bad.write_text("gpu: x\n")
    code, _, err = _run(capsys, "--config", "S", "--gpus", "8", "--cluster", str(bad))
    assert code == 2
    _one_error(err, f"--cluster {bad}: missing hardware field(s)", "gpu_memory_gib", "peak_bf16_tflops")
    code, _, err = _run(capsys, "--config", "S", "--gpus", "8", "--cluster", str(tmp_path))
    _one_error(err, "--cluster:", "is a directory")


def test_cluster_file_defaults_are_reported(capsys, tmp_path: Path) -> None:
    a100 = tmp_path / "a100.yaml"
    a100.write_text("gpu: A100-SXM4-80GB\ngpus_per_node: 8\ngpu_memory_gib: 79.2\npeak_bf16_tflops: 312\n"
                    "peak_fp8_tflops: null\nintra_node_gbps: 300\ninter_node_gbps: 25\nhbm_gbps: 2039\n")
    code, out, _ = _run(capsys, "--config", "S", "--gpus", "8", "--cluster", str(a100), "--steps", "1")
    assert code == 0
    assert "cluster a100: not in the description, defaults used for nodes, gemm_efficiency" in out
    code, out, err = _run(capsys, "--config", "S", "--gpus", "8", "--cluster", str(a100), "--fp8", "hybrid")
    assert code == 2
    _one_error(err, "model.fp8: cluster a100 (A100-SXM4-80GB) has no FP8 peak")


# ----------------------------------------------------------------------------- tools/ wrappers
@pytest.mark.parametrize("script,verb,module", [
    ("plan.py", "plan", "megaloop.plan.cli"),
    ("lr_screen.py", "lr-screen", "megaloop.screen.cli"),
    ("reproduce.py", "reproduce", "megaloop.repro.cli"),
    ("convert_to_hf.py", "convert", "megaloop.hf.convert_cli"),
])
def test_wrapper_ctrl_c_is_one_line_and_130(capsys, monkeypatch, script, verb, module) -> None:
    """tools/*.py go through megaloop/cli.py's entry, as `megaloop VERB` (no traceback on Ctrl-C)."""
    import importlib

    def interrupted(_argv=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(module), "main", interrupted)
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    monkeypatch.delenv("MEGALOOP_EXIT_STATUS_FILE", raising=False)
    try:
        runpy.run_path(str(ROOT / "tools" / script), run_name="__main__")
    except KeyboardInterrupt:
        pytest.fail(f"tools/{script} let Ctrl-C through (a traceback and exit 1)")
    except SystemExit as exc:
        code = exc.code
    else:
        pytest.fail(f"tools/{script} did not exit")
    assert code == 130
    assert capsys.readouterr().err.strip().splitlines() == [f"megaloop {verb}: interrupted"]


def test_a_flag_and_an_agreeing_override_plan_normally(capsys) -> None:
    """Agreement is not a contradiction, also when another override needs the flags (the first version of
    the check loaded the config without the flags and refused pp=1 for parallel.vpp=2)."""
    code, out, err = _run(capsys, "--config", "S", "--gpus", "8", "--pp", "4", "--mbs", "1", "--steps", "2",
                          "train.micro_batch_size=1", "parallel.vpp=2", "--fp8", "none", "model.fp8=null")
    assert code == 0 and "PP4" in out, err
