"""Decoding: tokens/s and KV bytes with terminal KV sharing vs the per-visit cache, at R=5 and 16.

Pure-PyTorch inference model (megaloop/hf/modeling_megaloop.py, the one evaluation uses), random
weights of the given shape, batch of prompts prefilled then greedy-decoded token by token. Modes
and depths alternate within one run. Usage:
    python tools/bench/bench_decode.py [--hidden 256 --prompt 128 --new 32 --batch 4 --reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import check_model_args, command, device, int_list, positive_int, sync, write_result
from common import check_results_dir


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=positive_int, default=256)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--prompt", type=positive_int, default=128)
    p.add_argument("--new", type=positive_int, default=32)
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--depths", type=int_list(1), default="5,16")
    p.add_argument("--reps", type=positive_int, default=3)
    args = p.parse_args()
    check_results_dir()
    check_model_args(p, args)
    from megaloop.hf.configuration_megaloop import MegaloopConfig
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM

    dev = device()
    cfg = MegaloopConfig(vocab_size=4096, hidden_size=args.hidden, num_attention_heads=args.heads,
                         max_position_embeddings=args.prompt + args.new + 8)
    model = MegaloopForCausalLM(cfg).to(dev).eval()
    ids = torch.randint(0, 4096, (args.batch, args.prompt), device=dev)

    @torch.no_grad()
    def run(mode, depth):
        cache = model.new_cache(mode)
        sync()
        t0 = time.perf_counter()
        out = model(ids, past_key_values=cache, num_recurrences=depth, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        sync()
        t1 = time.perf_counter()
        for _ in range(args.new):
            out = model(tok, past_key_values=cache, num_recurrences=depth, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
        sync()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, cache.kv_bytes(), cache.kv_bytes_per_token()

    cases = [(m, int(r)) for r in args.depths.split(",") for m in ("terminal", "per_visit")]
    for c in cases:
        run(*c)  # warm-up
    samples = {c: [] for c in cases}
    for _ in range(args.reps):
        for c in cases:
            samples[c].append(run(*c))
    rows = []
    for (mode, depth), s in samples.items():
        decode_s = statistics.median(x[1] for x in s)
        rows.append({"mode": mode, "depth": depth, "prefill_s": statistics.median(x[0] for x in s),
                     "decode_tokens_per_s": args.batch * args.new / decode_s,
                     "kv_bytes": s[0][2], "kv_bytes_per_token": s[0][3]})
        print(rows[-1])
    by = {(r["mode"], r["depth"]): r for r in rows}
    summary = {f"R{d}": {"kv_ratio_terminal_over_per_visit": by[("terminal", d)]["kv_bytes_per_token"]
                         / by[("per_visit", d)]["kv_bytes_per_token"],
                         "decode_speed_terminal_over_per_visit": by[("terminal", d)]["decode_tokens_per_s"]
                         / by[("per_visit", d)]["decode_tokens_per_s"]}
               for d in map(int, args.depths.split(","))}
    print(summary)
    write_result("decode" + ("_gpu" if dev == "cuda" else ""), {**vars(args), "device": dev},
                 {"rows": rows, "summary": summary},
                 command("bench_decode.py", args))


if __name__ == "__main__":
    main()
