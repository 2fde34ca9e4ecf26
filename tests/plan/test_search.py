"""`megaloop plan --search` ranks by expected throughput, not by which depths a layout drew.

The expected step time is exact without pipelining and a ratio estimator with a noise estimate
with it (megaloop/plan/search.py); the bound that lets the search skip layouts holds for every
simulated step; tokens/s and MFU rank alike; rows within the noise are said to be."""

from __future__ import annotations

import json
import math

import pytest

from megaloop.config import load_config
from megaloop.plan.cli import main as plan_main
from megaloop.plan.cluster import load_cluster
from megaloop.plan.cost import CostModel
from megaloop.plan.layout import depth_plans, make_layout
from megaloop.plan.search import evaluate, memory_plan, search


def _json(capsys, *argv: str) -> dict:
    code = plan_main(list(argv))
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_search_order_does_not_depend_on_the_sampled_steps(capsys) -> None:
    """S on 8 GPUs, PP1 (the audit's case: mbs8 beat mbs4 at 8 steps, mbs4 won at 32): without a
    pipeline the expected throughput is exact, so 2 and 8 sampled steps give the same rows."""
    argv = ("--config", "S", "--gpus", "8", "--search", "--tp", "1", "--pp", "1", "--vocab", "65536", "--json")
    a = _json(capsys, *argv, "--steps", "2")
    b = _json(capsys, *argv, "--steps", "8")
    rows = [[(p["layout_text"], p["steps"]["tokens_per_s"]) for p in r["plans"]] for r in (a, b)]
    assert rows[0] == rows[1]
    assert all(p["layout"]["tp"] == 1 and p["layout"]["pp"] == 1 for p in a["plans"])
    assert {p["steps"]["expected"]["tokens_per_s_se"] for p in a["plans"]} == {0.0}


def test_tokens_per_s_and_mfu_rank_alike(capsys) -> None:
    """The table's MFU column never rises while tokens/s falls (the old mean of per-step MFU
    did: tiny on 4 GPUs, rows 48-49 at 3 steps)."""
    code = plan_main(["--config", "tiny", "--gpus", "4", "--search", "--steps", "3", "--top", "50"])
    out = capsys.readouterr().out
    assert code == 0
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("  ") and line.strip()[0].isdigit()]
    mfu = [float(r[6]) for r in rows]
    tps = [float(r[-1].split()[0]) for r in rows]
    assert len(rows) == 50 and tps == sorted(tps, reverse=True)
    assert mfu == sorted(mfu, reverse=True)
    rep = _json(capsys, "--config", "tiny", "--gpus", "4", "--search", "--steps", "3", "--top", "50", "--json")
    # MFU = tokens/s x (model FLOPs per token) / (GPUs x peak): one constant for the whole search
    ratios = [p["steps"]["expected"]["mfu"] / p["steps"]["tokens_per_s"] for p in rep["plans"]]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-9)


@pytest.mark.parametrize("pp,mbs", [(1, 8), (2, 2)])
def test_expected_step_time_is_the_long_run_mean(pp: int, mbs: int) -> None:
    """The estimate from a few steps agrees with the plain mean over many (within its noise)."""
    cfg = load_config("tiny", [f"parallel.pp={pp}", f"train.micro_batch_size={mbs}", "train.global_batch_size=32"])
    layout = make_layout(cfg, 2 * pp)
    cluster = load_cluster("h100")
    many = evaluate(cfg, layout, cluster, 4096, 400, sampled_memory=False)
    mean, sd = many.steps["step_s"]["mean"], many.steps["step_s"]["std"]
    few = evaluate(cfg, layout, cluster, 4096, 12, sampled_memory=False).steps["expected"]
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    se = few["tokens_per_s_se"]
    if pp == 1:
        assert se == 0.0 and few["step_s"] == pytest.approx(many.steps["expected"]["step_s"], rel=1e-12)
    else:
        assert se > 0
    # the long-run mean's own noise (400 steps) plus the estimate's
    tol = 3 * math.hypot(sd / math.sqrt(400), few["step_s"] * se / few["tokens_per_s"]) + 1e-12
    assert abs(few["step_s"] - mean) <= tol, (few["step_s"], mean, tol)
    assert few["tokens_per_s"] == pytest.approx(tokens / few["step_s"])


@pytest.mark.parametrize("world,ov", [
    (4, ["parallel.pp=2", "train.micro_batch_size=2"]),
    (4, ["parallel.pp=4", "train.micro_batch_size=1"]),
    (8, ["parallel.pp=4", "parallel.vpp=2", "train.micro_batch_size=1"]),
    (4, ["parallel.pp=4", "parallel.vpp=4", "train.micro_batch_size=1"]),
])
def test_makespan_bound_holds_for_every_step(world: int, ov: list[str]) -> None:
    from megaloop.plan.layout import depth_law

    cfg = load_config("tiny", ov + ["depth.kind=pln", "depth.mean=5"])
    layout = make_layout(cfg, world)
    cost = CostModel(cfg, layout, load_cluster("h100"), 4096)
    S = layout.stages
    for depths in depth_plans(cfg, layout.microbatches, 25):
        est = cost.step(depths)
        f = [[cost.op_s("F", v, r) for v in range(S)] for r in depths]
        b = [[cost.op_s("B", v, r) for v in range(S)] for r in depths]
        bound = cost.makespan_bound(f[0], b[-1], f[0], b[0], est.sim.busy)
        assert est.sim.makespan >= bound * (1 - 1e-12)
    means = [cost.step(d).step_s for d in depth_plans(cfg, layout.microbatches, 25)]
    assert cost.expected_step_bound(depth_law(cfg)) <= sum(means) / len(means) * 1.05


def test_search_skips_only_layouts_that_cannot_make_the_list() -> None:
    """The bound-ordered search lists what simulating every fitting layout would."""
    cluster = load_cluster("h100", ["cluster.reserved_gib=0", "cluster.gpu_memory_gib=0.2"])
    plans, excluded = search("tiny", ["depth.kind=pln", "depth.mean=5"], cluster, 4, 4096, 4, top=4)
    assert excluded["simulated"] < excluded["fitting"]
    brute = []
    base = load_config("tiny", ["depth.kind=pln", "depth.mean=5"])
    from megaloop.plan.search import candidates

    seen = set()
    for ov in candidates(base, 4, cluster.gpus_per_node):
        try:
            cfg = load_config("tiny", ["depth.kind=pln", "depth.mean=5", *ov])
            layout = make_layout(cfg, 4)
        except Exception:
            continue
        if layout in seen:
            continue
        seen.add(layout)
        mem = memory_plan(cfg, layout, cluster, 4096)
        if mem.fits:
            brute.append(evaluate(cfg, layout, cluster, 4096, 4, plan=mem, sampled_memory=False))
    brute.sort(key=lambda p: (-p.steps["tokens_per_s"], p.largest["total"]))
    assert len(brute) == excluded["fitting"]
    assert [p.layout for p in plans] == [p.layout for p in brute[:4]]


def test_rows_within_the_noise_are_reported(capsys) -> None:
    from megaloop.plan.search import ties

    code = plan_main(["--config", "tiny", "--gpus", "4", "--search", "--min-pp", "2", "--steps", "2", "--top", "6"])
    out = capsys.readouterr().out
    assert code == 0
    assert "within the simulation's noise" in out and "± " in out
    # ties(): consecutive rows whose difference is within 2 standard errors
    cluster = load_cluster("h100")
    cfg = load_config("tiny", ["parallel.pp=2"])
    p = evaluate(cfg, make_layout(cfg, 2), cluster, 4096, 4, sampled_memory=False)

    def fake(tps: float, se: float):
        q = memory_plan(cfg, p.layout, cluster, 4096)
        q.steps = {"expected": {"tokens_per_s": tps, "tokens_per_s_se": se}}
        return q

    assert ties([fake(100, 1), fake(99, 1), fake(90, 1), fake(89.9, 0.01)]) == [(1, 2), (3, 4)]
    assert ties([fake(100, 0), fake(99, 0)]) == []
