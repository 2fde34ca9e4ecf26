"""`megaloop plan`: the report, JSON, --search, --preflight, and bad input (exit 2 naming the field)."""

from __future__ import annotations

import json
import re

import pytest

from megaloop.plan.cli import main as plan_main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = plan_main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv,field", [
    (["--cluster", "a100"], "cluster: unknown GPU/cluster 'a100'"),
    (["--gpus", "16", "--tp", "2", "--pp", "3"], "parallel: world size 16 is not divisible by tp*pp"),
    (["--gpus", "12", "--tp", "3"], "model.num_heads: 16 heads are not divisible by parallel.tp=3"),
    (["--gpus", "8", "--pp", "2", "--vpp", "2"], "parallel.vpp"),
    (["--gpus", "8", "train.global_batch_size=100"], "train.global_batch_size"),
    (["--gpus", "64", "--mbs", "8"], "train.global_batch_size"),  # 256 sequences < 8 x 64
    (["--gpus", "0"], "--gpus"),
    (["cluster.gpu_memory_gib=-1"], "cluster.gpu_memory_gib"),
    (["cluster.gpus_per_nod=4"], "cluster.gpus_per_nod: unknown field"),
    (["model.nonsense=1"], "model.nonsense: unknown field"),
    (["--config", "no_such_preset"], "no_such_preset"),
])
def test_bad_input_exits_2_naming_the_field(capsys, argv, field) -> None:
    code, out, err = _run(capsys, "--config", "S", *argv) if "--config" not in argv else _run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], err
    assert lines[0].startswith("megaloop plan: error: ")


def test_registered_in_megaloop_cli(capsys) -> None:
    from megaloop.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["plan", "--config", "S", "--gpus", "32", "--pp", "4", "--steps", "4"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert re.search(r"largest: pp rank [0-3] ", out), out
    for text in ("TP1 PP4 DP8 mbs4", "-> fits", "MFU", "bubble", "fixed depth 5",
                 "predictions"):
        assert text in out, text


def test_json_report(capsys) -> None:
    code, out, _ = _run(capsys, "--config", "M", "--gpus", "64", "--tp", "2", "--pp", "4", "--vpp", "2",
                        "--steps", "4", "--json")
    assert code == 0
    rep = json.loads(out)
    assert rep["layout"]["dp"] == 8 and rep["layout"]["vpp"] == 2 and rep["fits"] is True
    assert len(rep["memory_gib"]) == 4 and rep["predictions"] is True
    for key in ("params", "grads", "optimizer", "activations", "transient", "total"):
        assert rep["memory_gib"][0][key] >= 0
    assert 0 < rep["steps"]["mfu"]["mean"] < 1 and 0 <= rep["steps"]["bubble"]["mean"] < 1
    assert rep["steps"]["step_s"]["n"] == 4


def test_preflight_ok_and_refusal(capsys) -> None:
    code, out, err = _run(capsys, "--config", "L", "--gpus", "16", "--tp", "2", "--pp", "2", "--preflight")
    assert code == 0 and out.startswith("megaloop preflight: ok:") and not err
    code, out, err = _run(capsys, "--config", "L", "--gpus", "8", "--mbs", "64", "train.global_batch_size=1024",
                          "--preflight")
    assert code == 2 and not out
    (line,) = err.strip().splitlines()
    assert line.startswith("megaloop preflight: refusing: predicted not to fit") and "rank pp 0" in line


def test_preflight_auto_without_gpu_skips(capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out, _ = _run(capsys, "--config", "L", "--gpus", "8", "--cluster", "auto", "--preflight")
    assert code == 0 and "skipped" in out


def test_search_ranks_fitting_layouts_only(capsys) -> None:
    code, out, _ = _run(capsys, "--config", "tiny", "--gpus", "4", "--search", "--steps", "2", "--json", "--top", "50",
                        "cluster.reserved_gib=0", "cluster.gpu_memory_gib=0.1")
    assert code == 0
    rep = json.loads(out)
    plans = rep["plans"]
    assert plans and rep["excluded"]["memory"] > 0
    assert all(p["fits"] and p["memory_gib"][p["largest_rank"]]["total"] <= 0.1 for p in plans)
    tps = [p["steps"]["tokens_per_s"] for p in plans]
    assert tps == sorted(tps, reverse=True)
    assert all(p["layout"]["tp"] * p["layout"]["pp"] * p["layout"]["dp"] == 4 for p in plans)


def test_microbatch_sweep(capsys) -> None:
    code, out, _ = _run(capsys, "--config", "S", "--gpus", "32", "--pp", "4", "--steps", "8", "--json",
                        "--microbatch-sweep", "depth.kind=pln")
    rows = json.loads(out)["microbatch_sweep"]
    assert [r["microbatches"] for r in rows] == [4, 8, 16, 32, 64]
    assert rows[-1]["bubble_sampled"]["mean"] < rows[0]["bubble_sampled"]["mean"]
    assert rows[-1]["bubble_fixed"] < rows[0]["bubble_fixed"]
