"""The evaluation memory check's estimate (megaloop.eval.memory) against the measured peak.

Each case runs in its own process: a seeded random ``MegaloopForCausalLM`` of the case's shape is
built, random sequences are made, the process's peak-RSS mark is reset (Linux ``clear_refs``) and
read before and after one ``evaluate_ppl`` batch (``eval ppl`` / ``sweep``), one greedy
``InferenceEngine.generate`` call without EOS stops (``generate``, the harness's decode scoring;
estimate: ``estimate_decode_memory``), one ``eval copying`` probe at one depth
(``estimate_copy_memory``) or one ``eval fixed-point`` span (``estimate_fixed_point_memory``); the increase is the measured peak of what the batch added
(on CUDA: ``torch.cuda.max_memory_allocated`` increase). Ratio = measured / estimate:
≤ 1 means a batch the check admits (estimate ≤ 0.90 of free memory) fits; the further below 1, the
more it over-estimates and the more batches that would fit it refuses; above 1 it under-estimates. Writes tools/bench/results/eval_memory.json (eval_memory_mmap.json with
``--mmap-threshold``). Usage:
    python tools/bench/bench_eval_memory.py [--cases tiny_native_L2048_b4,wide_native_L2048_b2] [--mmap-threshold 65536]
    python tools/bench/bench_eval_memory.py --speed tiny_native_L2048_b4 [--mmap-threshold 65536]   # its speed cost
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import command, positive_int, write_result
from common import check_results_dir

# name: (hidden, heads, kv heads, ffn, vocab, seq_len, batch, depth, protocols)
CASES = {
    "tiny_native_L2048_b4": (128, 4, 4, 384, 4096, 2048, 4, 5, "native"),
    "tiny_native_L8192_b2": (128, 4, 4, 384, 4096, 8192, 2, 5, "native"),
    "tiny_per_visit_L4096_b2_R32": (128, 4, 4, 384, 4096, 4096, 2, 32, "per_visit"),
    "tiny_terminal_L4096_b2_R32": (128, 4, 4, 384, 4096, 4096, 2, 32, "terminal"),
    "wide_native_L2048_b2": (512, 8, 8, 1536, 32768, 2048, 2, 5, "native"),
    "wide_per_visit_L2048_b2_R16": (512, 8, 8, 1536, 32768, 2048, 2, 16, "per_visit"),
}
# generate cases, name: (hidden, heads, kv heads, ffn, vocab, prompt lengths, max new tokens, max context, depth,
# cache). Equal prompts all stop together (no row copy: the estimate's copy term is not spent); in the
# unequal case the longer prompt reaches the context first, and the other row's cache is copied.
GEN_CASES = {
    "gen_per_visit_p512_b2_R16": (128, 4, 4, 384, 4096, (512, 512), 1537, 2048, 16, "per_visit"),
    "gen_wide_terminal_p1024_b2_R4": (512, 8, 8, 1536, 32768, (1024, 1024), 1025, 4096, 4, "terminal"),
    "gen_per_visit_unequal_b2_R16": (128, 4, 4, 384, 4096, (768, 512), 2000, 2048, 16, "per_visit"),
}

# eval copying cases, name: (hidden, heads, kv heads, ffn, vocab, probe sequences, half length, depth)
COPY_CASES = {
    "copy_tiny_n16_half1024_R5": (128, 4, 4, 384, 4096, 16, 1024, 5),
    "copy_wide_n8_half512_R5": (512, 8, 8, 1536, 32768, 8, 512, 5),
}
# eval fixed-point cases (one span, FP32, math attention), name: (hidden, heads, kv heads, ffn, vocab, span
# tokens, recurrence limit per solve: enough to fill the 16-state cycle window; the memory held does not grow after)
FP_CASES = {
    "fixed_point_tiny_T2048": (128, 4, 4, 384, 4096, 2048, 32),
    "fixed_point_wide_T1024": (512, 8, 8, 1536, 32768, 1024, 32),
}


def _hwm_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def _mark(dev) -> int:
    """Reset the peak mark; return the current baseline (bytes)."""
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark to the current RSS
    return _hwm_kb() * 1024


def _peak(dev, base: int) -> int:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base)
    return int(_hwm_kb() * 1024 - base)


def _setup(d: int, h: int, kvh: int, ffn: int, vocab: int, ctx: int):
    """``(config, model, device)``: a seeded random ``MegaloopForCausalLM`` of this shape in eval mode,
    one torch thread (the children's common set-up)."""
    import torch

    from megaloop.hf.configuration_megaloop import MegaloopConfig
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = MegaloopConfig(vocab_size=vocab, hidden_size=d, num_attention_heads=h, num_key_value_heads=kvh,
                         intermediate_size=ffn, injection="parcae_nonorm", max_position_embeddings=ctx)
    return cfg, MegaloopForCausalLM(cfg).to(dev).eval(), dev


def _row(name: str, dev, cfg, *, seq_len: int, batch: int, depth: int, protocol: str, estimate: int, peak: int,
         **extra) -> dict:
    """One result row: the case's shape, the estimate and the measured peak (bytes) and their ratio."""
    return {"case": name, "device": dev.type, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
            "ffn": cfg.intermediate_size, "vocab": cfg.vocab_size, "seq_len": seq_len, "batch": batch,
            "depth": depth, "protocol": protocol, "estimate_bytes": estimate, "measured_bytes": int(peak),
            "ratio_measured_over_estimate": round(peak / estimate, 3), **extra}


def _parts(est) -> dict:
    return {"estimate_parts": {"logits": est.logits_bytes, "kv": est.kv_bytes, "activations": est.activation_bytes}}


def run_gen_case(name: str) -> dict:
    """Measure one generate case in this process (called in a child)."""
    import torch

    from megaloop.eval.memory import decode_positions, estimate_decode_memory
    from megaloop.inference.engine import InferenceEngine

    d, h, kvh, ffn, vocab, lens, new, ctx, depth, mode = GEN_CASES[name]
    cfg, model, dev = _setup(d, h, kvh, ffn, vocab, ctx)
    engine = InferenceEngine(model, None, depth=depth, cache_mode=mode)
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in lens]
    est = estimate_decode_memory(cfg, batch_size=len(lens), prompt_len=max(lens),
                                 total_len=decode_positions(lens, new, ctx), prefill_depth=depth, decode_depth=depth,
                                 mode=mode, padded=len(set(lens)) > 1, dtype=engine.dtype)
    engine.generate([prompts[0][:8]] * len(lens), max_new_tokens=20, stop_at_eos=False)  # first-call set-up
    base = _mark(dev)
    out = engine.generate(prompts, max_new_tokens=new, stop_at_eos=False)
    peak = _peak(dev, base)
    return _row(name, dev, cfg, seq_len=est.seq_len, batch=len(lens), depth=depth, protocol=f"generate/{mode}",
                estimate=est.total_bytes, peak=peak, prompt_lens=list(lens),
                finish=[r.finish_reason for r in out.results], measured_kv_peak_bytes=int(out.stats.kv_bytes_peak),
                **_parts(est))


def _ppl_case(name: str):
    """``(config, engine, data, device)`` of an ``evaluate_ppl`` case: random sequences of its shape."""
    import torch

    from megaloop.eval.text_data import EvalData
    from megaloop.inference.engine import InferenceEngine

    d, h, kvh, ffn, vocab, L, b, depth, _ = CASES[name]
    cfg, model, dev = _setup(d, h, kvh, ffn, vocab, L)
    tokens = torch.randint(0, vocab, (b, L))
    return cfg, InferenceEngine(model, None, depth=depth), EvalData(tokens, torch.roll(tokens, -1, 1),
                                                                    torch.ones(b, L)), dev


def run_case(name: str) -> dict:
    """Measure one ``evaluate_ppl`` case in this process (called in a child)."""
    from megaloop.eval.memory import estimate_eval_memory
    from megaloop.eval.ppl import evaluate_ppl

    _, _, _, _, _, L, b, depth, proto = CASES[name]
    cfg, engine, data, dev = _ppl_case(name)
    est = estimate_eval_memory(cfg, batch_size=b, seq_len=L, prefix_len=L // 2, depth=depth, protocols=(proto,),
                               dtype=engine.dtype)
    base = _mark(dev)
    evaluate_ppl(engine, data, depth=depth, protocols=(proto,), batch_size=b, prefix_len=L // 2)
    peak = _peak(dev, base)
    return _row(name, dev, cfg, seq_len=L, batch=b, depth=depth, protocol=proto, estimate=est.total_bytes,
                peak=peak, **_parts(est))


def run_copy_case(name: str) -> dict:
    """Measure one ``eval copying`` forward (copy_probe at one depth) in this process."""
    from megaloop.eval.copying import copy_probe
    from megaloop.eval.memory import estimate_copy_memory

    d, h, kvh, ffn, vocab, n, half, depth = COPY_CASES[name]
    cfg, model, dev = _setup(d, h, kvh, ffn, vocab, 2 * half)
    est = estimate_copy_memory(cfg, num_seqs=n, seq_len=2 * half)
    fn = lambda ids: model(input_ids=ids.to(dev), num_recurrences=depth).logits  # noqa: E731
    copy_probe(fn, vocab, num_seqs=1, half_len=8)  # first-call set-up
    base = _mark(dev)
    copy_probe(fn, vocab, num_seqs=n, half_len=half)
    return _row(name, dev, cfg, seq_len=2 * half, batch=n, depth=depth, protocol="copying", estimate=est,
                peak=_peak(dev, base))


def run_fp_case(name: str) -> dict:
    """Measure one ``eval fixed-point`` span (check_span, control depth 5, zero-init check) in this process."""
    import torch

    from megaloop.eval.memory import estimate_fixed_point_memory
    from megaloop.inference.fixed_point import Criteria, check_span

    d, h, kvh, ffn, vocab, t, steps = FP_CASES[name]
    cfg, model, dev = _setup(d, h, kvh, ffn, vocab, t)
    crit = Criteria(max_steps=steps)
    est = estimate_fixed_point_memory(cfg, span_len=t, cycle_window=crit.cycle_window)
    check_span(model, torch.randint(0, vocab, (8,)), Criteria(max_steps=4))  # first-call set-up
    base = _mark(dev)
    check_span(model, torch.randint(0, vocab, (t,)), crit)
    return _row(name, dev, cfg, seq_len=t, batch=1, depth=steps, protocol="fixed-point", estimate=est,
                peak=_peak(dev, base))


def time_case(name: str, repeats: int = 4) -> dict:
    """Seconds per ``evaluate_ppl`` batch of a ``CASES`` case (after one warm-up batch), in this process."""
    import time

    from megaloop.eval.ppl import evaluate_ppl

    _, _, _, _, _, L, b, depth, proto = CASES[name]
    _, engine, data, _ = _ppl_case(name)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        evaluate_ppl(engine, data, depth=depth, protocols=(proto,), batch_size=b, prefix_len=L // 2)
        times.append(time.perf_counter() - t0)
    return {"case": name, "seconds": [round(t, 3) for t in times[1:]]}


def _child(flag: str, name: str, threshold: int | None) -> dict:
    """Run this script's ``flag`` child for case ``name`` in a fresh process (one thread pool, as the
    child sets torch to; glibc's ``MALLOC_MMAP_THRESHOLD_`` when ``threshold`` is given) and return
    the JSON it prints."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    env["OMP_NUM_THREADS"] = "1"
    if threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    out = subprocess.run([sys.executable, __file__, flag, name], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"case {name} ({flag}) failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def speed(name: str, threshold: int, rounds: int = 2) -> dict:
    """Time ``name`` under glibc's default and under ``MALLOC_MMAP_THRESHOLD_=threshold``, alternating
    the two ``rounds`` times in fresh processes; the medians and their ratio."""
    import statistics

    runs: dict = {"default": [], "mmap_threshold": []}
    for _ in range(rounds):
        for key in runs:
            runs[key] += _child("--time-child", name, threshold if key != "default" else None)["seconds"]
    med = {k: statistics.median(v) for k, v in runs.items()}
    res = {"case": name, "seconds": runs, "median_s": med,
           "ratio_mmap_over_default": round(med["mmap_threshold"] / med["default"], 3)}
    print(f"{name}: median {med['default']:.3f} s (glibc default) vs {med['mmap_threshold']:.3f} s "
          f"(MALLOC_MMAP_THRESHOLD_={threshold}): ratio {res['ratio_mmap_over_default']:.2f}")
    return res


RUNNERS = {**{k: run_case for k in CASES}, **{k: run_gen_case for k in GEN_CASES},
           **{k: run_copy_case for k in COPY_CASES}, **{k: run_fp_case for k in FP_CASES}}


def case_names(text: str) -> str:
    """``type=`` of ``--cases``: one or more known cases, comma-separated; returns the string unchanged."""
    names = [c for c in text.split(",") if c]
    bad = [c for c in names if c not in RUNNERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{'unknown ' + str(bad) if bad else 'no case'}; known: {', '.join(RUNNERS)}")
    return text


def speed_case(text: str) -> str:
    """``type=`` of ``--speed``: an evaluate_ppl case."""
    if text not in CASES:
        raise argparse.ArgumentTypeError(f"{text!r} is not an evaluate_ppl case; known: {', '.join(CASES)}")
    return text


def main() -> None:
    p = argparse.ArgumentParser()
    known = RUNNERS
    p.add_argument("--cases", type=case_names, default=",".join(known), help=f"comma-separated, of {', '.join(known)}")
    p.add_argument("--mmap-threshold", type=positive_int, default=None, metavar="BYTES",
                   help="run the cases with glibc's MALLOC_MMAP_THRESHOLD_=BYTES (a fixed threshold: blocks above "
                        "it are mapped and returned when freed, so the peak RSS follows the live tensors); "
                        "writes eval_memory_mmap.json")
    p.add_argument("--speed", type=speed_case, default=None, metavar="CASE",
                   help="instead: time one evaluate_ppl case under glibc's default and under --mmap-threshold "
                        "(default 65536), alternating in fresh processes; writes eval_memory_speed.json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--time-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    check_results_dir()
    if args.child:
        print(json.dumps(RUNNERS[args.child](args.child)))
        return
    if args.time_child:
        print(json.dumps(time_case(args.time_child)))
        return
    if args.speed:
        threshold = args.mmap_threshold or 65536
        res = speed(args.speed, threshold)
        args.cases = None  # not used by --speed: left out of the recorded command
        write_result("eval_memory_speed", {"case": args.speed, "malloc_mmap_threshold": threshold}, res,
                     command("bench_eval_memory.py", args))
        return
    names = [c for c in args.cases.split(",") if c]
    rows = []
    for name in names:
        row = _child("--child", name, args.mmap_threshold)
        rows.append(row)
        print(f"{name:32s} estimate {row['estimate_bytes'] / 2**20:9.1f} MiB  measured "
              f"{row['measured_bytes'] / 2**20:9.1f} MiB  ratio {row['ratio_measured_over_estimate']:.3f}")
    write_result("eval_memory" if args.mmap_threshold is None else "eval_memory_mmap",
                 {"cases": names, "malloc_mmap_threshold": args.mmap_threshold}, rows,
                 command("bench_eval_memory.py", args))


if __name__ == "__main__":
    main()
