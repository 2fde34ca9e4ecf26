"""Render the README's benchmark table from tools/bench/results/*.json.

    python tools/bench/report.py            # rewrite the table between the README markers
    python tools/bench/report.py --print    # print it only
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BEGIN, END = "<!-- BENCH-TABLE -->", "<!-- /BENCH-TABLE -->"


def _f(x: float, nd: int = 2) -> str:
    return f"{x:.{nd}f}"


def _row(d: dict) -> tuple[str, str] | None:
    name, r, c = d["benchmark"], d["results"], d["config"]
    if name.startswith("loop_overhead"):
        return (f"Loop overhead ({c.get('device')}): looped R=5 step / megatron GPTModel 12 layers, d={c['hidden']}, "
                f"s={c['seq']}, b={c['batch']}",
                f"b=R: **{_f(r['ratio_looped_b5_over_gpt12'])}×**, b=2: {_f(r['ratio_looped_b2_over_gpt12'])}×")
    if name.startswith("vs_plain_pytorch"):
        t = r["model_tflops"]
        return (f"Train step, megaloop (megatron-core layers) / plain-PyTorch looped model, same shape and FLOPs "
                f"({c.get('device')}, d={c['hidden']}, s={c['seq']}, b={c['batch']}, R={c['depth']}, full BPTT)",
                f"step time **{_f(r['ratio_megaloop_over_plain_step_time'])}×** (model TFLOP/s "
                f"{t['megaloop']:.3g} vs {t['plain_pytorch']:.3g})")
    if name.startswith("vs_refs"):
        t, ratio = r["model_tflops"], r["ratio_megaloop_over_reference_step_time"]
        paired = r.get("ratio_paired_median") or {}
        parts = [f"{n.capitalize()}: step time **{_f(v)}×**"
                 + (f" (per-round median {_f(paired[n])}×)" if n in paired else "")
                 + f", model TFLOP/s {t[f'megaloop_{n}_matched']:.3g} vs {t[f'{n}_reference']:.3g} (commit "
                 f"{r['reference_commits'][n][:8]})" for n, v in ratio.items()]
        return (f"Train step, megaloop reference-matched config / the reference's own code, same shape and "
                f"parameters, both credited megaloop's FLOPs (Parcae's code recomputes its B·e every recurrence: "
                f"~2 % more arithmetic) ({c.get('device')}, d={c['hidden']}, s={c['seq']}, b={c['batch']}, R={c['depth']}, "
                f"backprop through {c['bptt_window']})", "; ".join(parts))
    if name == "rewards":
        rows = r["rows"]
        before = next((x for x in rows if x["variant"] == "before"), None)  # absent: --before-rev not in git

        def rate(x: dict) -> str:  # best round (median round)
            med = x.get("rewards_per_s_median")
            return f"{x['rewards_per_s']}" + (f" (median {med})" if med is not None else "")

        after = ", ".join(f"{x['workers']} worker{'s' if x['workers'] > 1 else ''} {rate(x)}"
                          for x in rows if x["variant"] != "before")
        return (f"Code-execution rewards/s on mbpp:tiny (bwrap sandbox + trusted verdict vs the old unsandboxed "
                f"subprocess), best of {c.get('rounds', '?')} interleaved rounds (median); CPU ms per reward",
                (f"before {rate(before)}, {before['cpu_ms_per_reward']} ms; " if before else "before: not measured; ")
                + f"after: {after}; "
                f"({min(x['cpu_ms_per_reward'] for x in rows if x['variant'] != 'before')}–"
                f"{max(x['cpu_ms_per_reward'] for x in rows if x['variant'] != 'before')} ms)")
    if name == "eval_memory_speed":
        m = r["median_s"]
        return (f"Evaluation speed under glibc `MALLOC_MMAP_THRESHOLD_={c['malloc_mmap_threshold']}` / glibc default, "
                f"one `evaluate_ppl` batch (`{c['case']}`, CPU, median of {len(r['seconds']['default'])} each)",
                f"**{_f(r['ratio_mmap_over_default'])}×** ({_f(m['mmap_threshold'], 3)} s vs {_f(m['default'], 3)} s)")
    if name in ("eval_memory", "eval_memory_mmap"):
        def span(key: str, fmt: str = "{:,}") -> str:
            return "–".join(fmt.format(v) for v in sorted({min(x[key] for x in r), max(x[key] for x in r)}))

        protos = ", ".join(sorted({x["protocol"] for x in r}))
        kind = {"copying": "`eval copying` probe", "fixed-point": "`eval fixed-point` span"}
        groups: dict = {}
        for x in r:
            p = x["protocol"]
            k = "`generate` call" if p.startswith("generate/") else kind.get(p, "`evaluate_ppl` batch")
            groups.setdefault(k, []).append(x)
        found = {k: [x["ratio_measured_over_estimate"] for x in v] for k, v in groups.items() if v}
        env = (f", glibc `MALLOC_MMAP_THRESHOLD_={c['malloc_mmap_threshold']}`" if c.get("malloc_mmap_threshold")
               else "")
        return (f"Evaluation memory check: measured peak / estimate of one {' or one '.join(found)} "
                f"({len(r)} cases: {protos}; d={span('hidden', '{}')}, vocab {span('vocab')}, "
                f"positions {span('seq_len')}{env})",
                "; ".join(f"{k.split('`')[1]}: **{min(v):.2f}–{max(v):.2f}×**" for k, v in found.items())
                + " (check refuses above 0.90 of free memory)")
    if name.startswith("tbptt_memory"):
        s = r["summary"]
        lo, hi = c.get("compare", "8,32").split(",")
        return (f"TBPTT activation memory, depth {hi} / depth {lo}, d={c['hidden']}, s={c['seq']}, b={c['batch']}",
                f"b=4: **{_f(s[f'b4_depth{hi}_over_depth{lo}'])}×**, b=r: {_f(s[f'br_depth{hi}_over_depth{lo}'])}×")
    if name.startswith("decode"):
        parts = [f"R={k[1:]}: KV {_f(v['kv_ratio_terminal_over_per_visit'], 3)}×, decode speed "
                 f"{_f(v['decode_speed_terminal_over_per_visit'])}×" for k, v in r["summary"].items()]
        return (f"Decoding, terminal sharing / per-visit cache ({c.get('device')}), d={c['hidden']}, prompt {c['prompt']}",
                "; ".join(parts))
    if name == "loader_vs_train":
        return ("Data loader vs tiny training consumption (tokens/s)",
                f"loader {r['loader_tokens_per_s']:,.0f} vs train {r['train_tokens_per_s']:,.0f}: "
                f"**{_f(r['loader_over_train'], 0)}×**")
    if name == "cpu_compat_overhead":
        return ("CPU compatibility layer: tiny step with forward under the redirect mode / without",
                f"**{_f(r['mode_cost_ratio'])}×**")
    if name == "rl_reuse":
        s = r["summary"]
        return ("RL update (Neumann endpoint reuse): time R=32 / R=5; speed-up over full BPTT",
                f"reuse R32/R5: **{_f(s['reuse_time_ratio_R32_over_R5'])}×** (BPTT {_f(s['bptt_time_ratio_R32_over_R5'])}×); "
                f"reuse vs BPTT at R=5: **{_f(s['speedup_reuse_over_bptt_R5'])}×** faster, at R=32 "
                f"{_f(s['speedup_reuse_over_bptt_R32'], 1)}×")
    if name.startswith("adaptive_depth"):
        s = r["summary"]
        return (f"Adaptive per-token depth vs {s['reference']} ({c.get('device')}, terminal KV, max depth "
                f"{c['max_depth']})",
                f"{s['best_adaptive']}: PPL {_f(s['best_ppl_over_fixed_max'], 3)}× at "
                f"**{_f(s['best_depth_over_fixed_max'], 3)}×** the recurrences, decode "
                f"**{_f(s['best_speed_over_fixed_max'])}×** faster")
    if name == "distill_prefill":
        more = "; ".join(f"R={d}: {_f(v['ratio_median'])}×" for d, v in sorted((r.get("by_depth") or {}).items(),
                         key=lambda kv: int(kv[0])) if int(d) != c["depth"])
        return (f"Distilled prefill: student / teacher prefill latency at R={c['depth']} (and R=1, 2, 3)",
                f"**{_f(r['ratio_median'])}×** ({_f(r['speedup_median'])}× faster)" + (f"; {more}" if more else ""))
    if name == "loader":
        best = max(r, key=lambda x: x["tokens_per_s"]) if isinstance(r, list) else None
        return ("Loader alone (best case)", f"{best['tokens_per_s']:,} tokens/s ({best['dataset']}, "
                                            f"{best['num_workers']} workers)") if best else None
    return None


def _gpu_check_row(d: dict) -> tuple[str, str] | None:
    """tools/gpu_check.sh's summary (copied to results/gpu_check.json on a GPU machine)."""
    if d.get("mode") != "gpu":
        return None
    parts = []
    for run, r in sorted((d.get("train") or {}).items()):
        m = r.get("median") or {}
        if m.get("tokens_per_s"):
            mfu = f", MFU {100 * m['mfu']:.1f} %" if m.get("mfu") else ""
            mem = f", peak {m['peak_mem_gib']:.1f} GiB" if m.get("peak_mem_gib") else ""
            parts.append(f"{r.get('config') or ''} {run}: **{m['tokens_per_s']:,.0f} tokens/s**{mfu}{mem}")
    lo = d.get("loop_overhead") or {}
    if lo.get("ratio_looped_b5_over_gpt12"):
        parts.append(f"loop overhead b=R {_f(lo['ratio_looped_b5_over_gpt12'])}×")
    lg = d.get("logits") or {}
    if "fp32_max_abs_err" in lg:
        parts.append(f"GPU vs CPU FP32 logits max|Δ| {lg['fp32_max_abs_err']:.1e}")
    if d.get("ok") is not True:  # a failed check is copied too (what it measured is a record): said so first
        problems = "; ".join(str(p) for p in (d.get("problems") or [])) or "no problems recorded"
        parts.insert(0, f"**check FAILED** ({problems})")
    return ("GPU check (`tools/gpu_check.sh`): training throughput, MFU, peak memory", "; ".join(parts))


def render() -> str:
    lines = ["| benchmark | result | machine, date | command |", "|---|---|---|---|"]
    for path in sorted((HERE / "results").glob("*.json")):
        try:
            d = json.loads(path.read_text())
        except ValueError as err:
            raise SystemExit(f"report.py: {path}: not valid JSON ({err})") from None
        make_row = _gpu_check_row if path.stem == "gpu_check" else _row if "benchmark" in d else None
        try:
            row = make_row(d) if make_row else None
        except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as err:
            # a result of options its row does not table (e.g. other --depths): one line naming it
            raise SystemExit(f"report.py: {path}: its row cannot be made ({type(err).__name__}: {err}); it was "
                             f"written by `{d.get('command', '?')}`: rerun it with the committed options, or keep "
                             "ad-hoc runs out of tools/bench/results with MEGALOOP_BENCH_RESULTS=DIR") from None
        if row is None:
            continue
        if path.stem == "gpu_check":
            lines.append(f"| {row[0]} | {row[1]} | {d.get('device_name')}, {str(d.get('date', ''))[:10]} | "
                         "`bash tools/gpu/fetch_wheels.sh` here, then `bash tools/gpu_check.sh` on the GPU |")
            continue
        m = d.get("machine", {})
        threads = m.get("threads")
        where = m.get("gpu") or (f"{m.get('cpus', '?')} CPU cores"
                                 + (f", {threads} thread{'s' if threads != 1 else ''}" if threads else ""))
        lines.append(f"| {row[0]} | {row[1]} | {where}, {d.get('date', '')} | `{d.get('command', '')}` |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--print", action="store_true")
    args = p.parse_args()
    table = render()
    if args.print:
        print(table)
        return
    readme = ROOT / "README.md"
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")
    print(f"updated {readme}")


if __name__ == "__main__":
    main()
