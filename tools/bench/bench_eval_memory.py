"""The evaluation memory check's estimate (megaloop.eval.memory) against the measured peak.

Each case runs in its own process: a seeded random ``MegaloopForCausalLM`` of the case's shape is
built, random sequences are made, the process's peak-RSS mark is reset (Linux ``clear_refs``) and
read before and after one ``evaluate_ppl`` batch; the increase is the measured peak of what the
batch added (on CUDA: ``torch.cuda.max_memory_allocated`` increase). Ratio = measured / estimate:
≤ 1 means the check never refuses a batch that fits by more than its margin; the further below 1,
the more it over-estimates. Writes tools/bench/results/eval_memory.json. Usage:
    python tools/bench/bench_eval_memory.py [--cases tiny,wide]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from common import command, write_result

# name: (hidden, heads, kv heads, ffn, vocab, seq_len, batch, depth, protocols)
CASES = {
    "tiny_native_L2048_b4": (128, 4, 4, 384, 4096, 2048, 4, 5, "native"),
    "tiny_native_L8192_b2": (128, 4, 4, 384, 4096, 8192, 2, 5, "native"),
    "tiny_per_visit_L4096_b2_R32": (128, 4, 4, 384, 4096, 4096, 2, 32, "per_visit"),
    "tiny_terminal_L4096_b2_R32": (128, 4, 4, 384, 4096, 4096, 2, 32, "terminal"),
    "wide_native_L2048_b2": (512, 8, 8, 1536, 32768, 2048, 2, 5, "native"),
    "wide_per_visit_L2048_b2_R16": (512, 8, 8, 1536, 32768, 2048, 2, 16, "per_visit"),
}


def _hwm_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_case(name: str) -> dict:
    """Measure one case in this process (called in a child)."""
    import torch

    from megaloop.eval.memory import estimate_eval_memory
    from megaloop.eval.ppl import evaluate_ppl
    from megaloop.eval.text_data import EvalData
    from megaloop.hf.configuration_megaloop import MegaloopConfig
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM
    from megaloop.inference.engine import InferenceEngine

    d, h, kvh, ffn, vocab, L, b, depth, proto = CASES[name]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = MegaloopConfig(vocab_size=vocab, hidden_size=d, num_attention_heads=h, num_key_value_heads=kvh,
                         intermediate_size=ffn, injection="parcae_nonorm", max_position_embeddings=L)
    engine = InferenceEngine(MegaloopForCausalLM(cfg).to(dev).eval(), None, depth=depth)
    tokens = torch.randint(0, vocab, (b, L))
    data = EvalData(tokens, torch.roll(tokens, -1, 1), torch.ones(b, L))
    prefix = L // 2
    protocols = (proto,)
    est = estimate_eval_memory(cfg, batch_size=b, seq_len=L, prefix_len=prefix, depth=depth,
                               protocols=protocols, dtype=engine.dtype)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS mark to the current RSS
        base = _hwm_kb() * 1024
    evaluate_ppl(engine, data, depth=depth, protocols=protocols, batch_size=b, prefix_len=prefix)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _hwm_kb() * 1024 - base
    return {"case": name, "device": dev.type, "hidden": d, "heads": h, "ffn": ffn, "vocab": vocab, "seq_len": L,
            "batch": b, "depth": depth, "protocol": proto, "estimate_bytes": est.total_bytes,
            "estimate_parts": {"logits": est.logits_bytes, "kv": est.kv_bytes, "activations": est.activation_bytes},
            "measured_bytes": int(peak), "ratio_measured_over_estimate": round(peak / est.total_bytes, 3)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(run_case(args.child)))
        return
    names = [c for c in args.cases.split(",") if c]
    bad = [c for c in names if c not in CASES]
    if bad:
        sys.exit(f"--cases: unknown {bad}; known: {', '.join(CASES)}")
    rows = []
    for name in names:
        out = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"case {name} failed:\n{out.stderr[-2000:]}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{name:32s} estimate {row['estimate_bytes'] / 2**20:9.1f} MiB  measured "
              f"{row['measured_bytes'] / 2**20:9.1f} MiB  ratio {row['ratio_measured_over_estimate']:.3f}")
    write_result("eval_memory", {"cases": names}, rows, command("bench_eval_memory.py", args))


if __name__ == "__main__":
    main()
