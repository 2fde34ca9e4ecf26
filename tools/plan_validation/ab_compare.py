"""Compare timing runs of tools/plan_validation/run.py made by two versions of the code, round by
round (same layouts, same depth draws): bubble and summed measured step makespan.

    python tools/plan_validation/ab_compare.py --a A1.json A2.json ... --b B1.json B2.json ...

Round i pairs A_i with B_i. Prints, per timing run, each round's bubble A -> B and makespan ratio B/A,
and their means (ratio: mean ± sd over rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def _read(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"ab_compare: {path}: cannot be read as JSON "
                         f"({getattr(err, 'strerror', None) or err})") from None
    if not isinstance(data, dict):
        raise SystemExit(f"ab_compare: {path}: not a run.py results file (a JSON object)")
    return data


def compare(a_files: list[str], b_files: list[str]) -> dict[str, dict]:
    if len(a_files) != len(b_files) or not a_files:
        raise SystemExit("ab_compare: --a and --b need the same number (>= 1) of result files")
    out: dict[str, dict] = {}
    pairs = [(_read(a), _read(b)) for a, b in zip(a_files, b_files)]
    names = [k for k, v in pairs[0][0].items() if isinstance(v, dict) and v.get("mode") == "timing"]
    if not names:
        raise SystemExit(f"ab_compare: {a_files[0]} holds no timing run (tools/plan_validation/run.py results)")
    for name in names:
        rounds = []
        for i, (a, b) in enumerate(pairs):
            for side, files in ((a, a_files), (b, b_files)):
                if not isinstance(side.get(name), dict) or "rows" not in side[name]:
                    raise SystemExit(f"ab_compare: {files[i]} has no timing run {name!r}")
            ra, rb = a[name]["rows"], b[name]["rows"]
            if [r["depths"] for r in ra] != [r["depths"] for r in rb]:
                raise SystemExit(f"ab_compare: {name}: round {i + 1} drew different depths in A and B")
            ma = sum(r["measured_makespan_s"] for r in ra)
            mb = sum(r["measured_makespan_s"] for r in rb)
            rounds.append({"bubble_a": a[name]["mean"]["measured_bubble"], "bubble_b": b[name]["mean"]["measured_bubble"],
                           "makespan_a_s": ma, "makespan_b_s": mb, "ratio": mb / ma,
                           "predicted_a": a[name]["mean"]["sim_cost_model"], "predicted_b": b[name]["mean"]["sim_cost_model"]})
        ratios = [r["ratio"] for r in rounds]
        out[name] = {"rounds": rounds,
                     "bubble_a": statistics.mean(r["bubble_a"] for r in rounds),
                     "bubble_b": statistics.mean(r["bubble_b"] for r in rounds),
                     "predicted_a": statistics.mean(r["predicted_a"] for r in rounds),
                     "predicted_b": statistics.mean(r["predicted_b"] for r in rounds),
                     "ratio_mean": statistics.mean(ratios),
                     "ratio_sd": statistics.stdev(ratios) if len(ratios) > 1 else 0.0}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", nargs="+", required=True)
    p.add_argument("--b", nargs="+", required=True)
    args = p.parse_args(argv)
    for name, r in compare(args.a, args.b).items():
        print(f"{name}: bubble {100 * r['bubble_a']:.1f} -> {100 * r['bubble_b']:.1f} % (cost model "
              f"{100 * r['predicted_a']:.1f} -> {100 * r['predicted_b']:.1f} %), makespan B/A "
              f"{r['ratio_mean']:.3f} ± {r['ratio_sd']:.3f}")
        for i, x in enumerate(r["rounds"], 1):
            print(f"  round {i}: bubble {100 * x['bubble_a']:.1f} -> {100 * x['bubble_b']:.1f} %, makespan "
                  f"{x['makespan_a_s']:.3f} -> {x['makespan_b_s']:.3f} s ({x['ratio']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
