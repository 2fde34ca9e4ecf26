#!/usr/bin/env python
"""Benchmark code-execution rewards: rewards/s on the shipped MBPP+-style tasks, before and after
the bubblewrap sandbox (issue #21).

    python tools/bench/bench_rewards.py [--repeats 4] [--rounds 3] [--workers 1,2,4] [--before-rev REV]

Each of the ``mbpp:tiny`` tasks is scored with its reference solution (reward 1) and a wrong one
(reward 0), ``--repeats`` times per round: rewards/s = scored completions / wall time, best and
median of ``--rounds`` rounds that interleave the variants, and CPU ms per reward (this process +
the sandboxes it reaped: independent of other load on the machine). Rows:

* ``before`` — the previous reward (``megaloop/rl/sandbox.py`` at ``--before-rev``: one
  subprocess per completion with an in-interpreter audit hook, exit status as the verdict; no
  namespaces), sequential, loaded from git (skipped when git or the revision is missing);
* ``after, workers=N`` — the sandboxed reward (bwrap namespaces, per-run uid, trusted verdict),
  ``CodeTask.reward_many`` on a pool of N sandboxes.

Every row counts the rewards that differ from the expected ones (references 1.0, wrong solutions
0.0; on a saturated machine a reference can hit the 5 s wall limit). Writes
``tools/bench/results/rewards.json`` through ``common.write_result``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, command, int_list, positive_int, write_result
from common import check_results_dir

BEFORE_REV = "65b0666500831c2c639c2d25246bbec2180e10e8"  # last revision of the unsandboxed reward


def _pairs(task, repeats: int) -> tuple[list, list]:
    from megaloop.post.rl.sandbox import DATA_DIR

    recs = [json.loads(l) for l in (DATA_DIR / "mbpp_tiny.jsonl").read_text().splitlines() if l.strip()]
    pairs, want = [], []
    for ex, rec in zip(task.examples, recs):
        pairs += [(ex, rec["canonical"]), (ex, "    return None\n")]
        want += [1.0, 0.0]
    return pairs * repeats, want * repeats


def _old_module(rev: str):
    """The sandbox module of ``rev`` (``megaloop/rl/sandbox.py`` before the move to ``megaloop/post/rl``,
    else the new path), its ``megaloop.rl.tasks`` import pointed at today's ``megaloop.post.rl.examples``
    (the same ``Example`` and ``read_jsonl``); None when git or the revision is missing."""
    src = None
    for path in ("megaloop/rl/sandbox.py", "megaloop/post/rl/sandbox.py"):
        try:
            src = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout
            break
        except (OSError, subprocess.CalledProcessError):
            continue
    if src is None:
        return None
    src = src.replace("from megaloop.rl.tasks import", "from megaloop.post.rl.examples import")
    with tempfile.TemporaryDirectory(prefix="megaloop-bench-") as tmp:
        path = Path(tmp) / "old_sandbox.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location("megaloop_old_sandbox", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
    return mod


def _cpu() -> float:
    """CPU seconds of this process and its reaped descendants (the sandboxes), user + system."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _time(fn, pairs, want) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, rewards that differ from the expected ones) of scoring ``pairs``;
    CPU time does not depend on the machine's load (wrong rewards: the 5 s limit hit on a
    saturated machine)."""
    c, t = _cpu(), time.perf_counter()
    got = fn(pairs)
    dt, dc = time.perf_counter() - t, _cpu() - c
    return dt, dc, sum(g != w for g, w in zip(got, want))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=positive_int, default=4, help="passes over the tasks per round")
    p.add_argument("--rounds", type=positive_int, default=3, help="timed rounds per variant (best and median kept)")
    p.add_argument("--workers", type=int_list(1), default="1,2,4", help="comma-separated pool sizes")
    p.add_argument("--before-rev", default=BEFORE_REV)
    args = p.parse_args()
    check_results_dir()
    from megaloop.post.rl.sandbox import CodeTask, CodeTaskConfig, sandbox_backend

    backend = sandbox_backend()
    if backend.kind != "bwrap":
        raise SystemExit(f"no working sandbox: {backend.reason}")
    variants = []  # (name, isolation, workers, fn, pairs, want)
    stats = {}  # sandbox run outcomes of the "after" variants
    old = _old_module(args.before_rev)
    if old is not None:
        from megaloop.post.rl.sandbox import DATA_DIR

        task = old.CodeTask(DATA_DIR / "mbpp_tiny.jsonl")
        variants.append(("before", "subprocess + audit hook (no namespaces)", 1,
                         lambda ps, t=task: [t.reward(e, c) for e, c in ps], *_pairs(task, args.repeats)))
    for n in [int(w) for w in args.workers.split(",")]:
        task = CodeTask("tiny", config=CodeTaskConfig(workers=n))
        variants.append((f"after, workers={n}", task.isolation, n, task.reward_many, *_pairs(task, args.repeats)))
        stats[variants[-1][0]] = task._reward.stats
    times: dict[str, list[float]] = {v[0]: [] for v in variants}
    cpus: dict[str, list[float]] = {v[0]: [] for v in variants}
    wrong: dict[str, int] = {v[0]: 0 for v in variants}
    for v in variants:
        v[3](v[4][:2])  # warm-up (imports, the pool's threads)
    for _ in range(args.rounds):  # rounds interleave the variants: a shared machine's load hits them alike
        for name, _, _, fn, pairs, want in variants:
            wall, cpu, bad = _time(fn, pairs, want)
            times[name].append(wall)
            cpus[name].append(cpu)
            wrong[name] += bad
    results = []
    for name, iso, n, _, pairs, _ in variants:
        ts = sorted(times[name])
        results.append({"variant": name, "isolation": iso, "workers": n, "completions": len(pairs),
                        "seconds_best": round(ts[0], 3), "seconds_median": round(ts[len(ts) // 2], 3),
                        "rewards_per_s": round(len(pairs) / ts[0], 1),
                        "rewards_per_s_median": round(len(pairs) / ts[len(ts) // 2], 1),
                        "cpu_ms_per_reward": round(1000 * sorted(cpus[name])[len(ts) // 2] / len(pairs), 1),
                        "wrong_rewards": wrong[name], "sandbox_runs": stats.get(name)})
    for r in results:
        print(f"{r['variant']:18s} {r['rewards_per_s']:8.1f} rewards/s best, {r['rewards_per_s_median']:8.1f} median, "
              f"{r['cpu_ms_per_reward']:6.1f} CPU ms/reward ({r['completions']} per round, "
              f"{r['wrong_rewards']} wrong)")
    base = next((r["rewards_per_s"] for r in results if r["variant"] == "before"), None)
    summary = {"before_rewards_per_s": base, "wrong_rewards": {r["variant"]: r["wrong_rewards"] for r in results},
               "cpu_ms_per_reward": {r["variant"]: r["cpu_ms_per_reward"] for r in results},
               "after_rewards_per_s": {r["workers"]: r["rewards_per_s"] for r in results if r["variant"] != "before"}}
    if base:
        summary["after_over_before"] = {k: round(v / base, 2) for k, v in summary["after_rewards_per_s"].items()}
    config = {"repeats": args.repeats, "rounds": args.rounds, "workers": args.workers, "before_rev": args.before_rev,
              "tasks": "mbpp:tiny", "bwrap": backend.bwrap, "layout": backend.layout,
              "load_avg_1min": round(os.getloadavg()[0], 2)}
    write_result("rewards", config, {"rows": results, "summary": summary}, command("bench_rewards.py", args))


if __name__ == "__main__":
    sys.exit(main())
