"""TBPTT memory: activation memory of one training step vs depth, for b=4 and b=r.

Activation memory = bytes of tensors autograd saves for backward during the forward (counted
once per storage through ``torch.autograd.graph.saved_tensors_hooks``), which is what grows with
depth; on CUDA the peak allocator memory is reported too. Usage:
    python tools/bench/bench_tbptt_memory.py [--hidden 256 --seq 256 --batch 4]
"""

from __future__ import annotations

import argparse

import torch
from common import (check_model_args, command, device, model_args, native_model, single_process_megatron, user_errors,
                    write_result)
from common import check_results_dir


class SavedBytes:
    def __init__(self):
        self.seen, self.bytes = set(), 0

    def pack(self, t):
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if key not in self.seen:
            self.seen.add(key)
            self.bytes += st.nbytes()
        return t

    @staticmethod
    def unpack(t):
        return t


def measure(model, ids, depth, window):
    counter = SavedBytes()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        loss = model(ids, labels=ids, depth=depth, bptt_window=window, noise_seed=0).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return counter.bytes, peak


def main():
    p = argparse.ArgumentParser()
    model_args(p, seq=256, batch=4)
    p.add_argument("--depths", default="4,8,16,32")
    p.add_argument("--compare", default="8,32", help="LO,HI: the summary's ratio depth HI / depth LO (both in --depths)")
    args = p.parse_args()
    check_results_dir()
    try:
        depths = [int(x) for x in args.depths.split(",")]
        lo, hi = (int(x) for x in args.compare.split(","))
    except ValueError:
        p.error(f"--depths {args.depths!r} / --compare {args.compare!r}: comma-separated integers (--compare: two)")
    if min(depths) < 1 or lo not in depths or hi not in depths or lo == hi:
        p.error(f"--compare {args.compare}: two different depths of --depths {args.depths} (all >= 1)")
    check_model_args(p, args)
    single_process_megatron()
    from megaloop.model.config import ModelConfig

    with user_errors(p):  # what ModelConfig refuses of the shape: one line, exit 2
        cfg = ModelConfig(hidden_size=args.hidden, num_heads=args.heads, seq_len=args.seq, bptt_window=64)
    dev = device()
    model = native_model(cfg, args.vocab).to(dev)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    rows = []
    for depth in depths:
        for label, window in (("b=4", min(4, depth)), ("b=r", depth)):
            act, peak = measure(model, ids, depth, window)
            rows.append({"depth": depth, "window": label, "activation_MiB": act / 2**20,
                         "peak_alloc_MiB": None if peak is None else peak / 2**20})
            print(f"depth {depth:3d} {label:4s} activations {act / 2**20:9.1f} MiB")
    by = {(r["depth"], r["window"]): r["activation_MiB"] for r in rows}
    summary = {f"b4_depth{hi}_over_depth{lo}": by[(hi, "b=4")] / by[(lo, "b=4")],
               f"br_depth{hi}_over_depth{lo}": by[(hi, "b=r")] / by[(lo, "b=r")]}
    print(summary)
    write_result("tbptt_memory" + ("_gpu" if dev == "cuda" else ""), {**vars(args), "device": dev},
                 {"rows": rows, "summary": summary},
                 command("bench_tbptt_memory.py", args))


if __name__ == "__main__":
    main()
