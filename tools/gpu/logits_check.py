"""TP=1 logits on the GPU (FP32 and bf16 autocast) vs the CPU FP32 reference of the same weights.

Part of tools/gpu_check.sh; prints JSON (and writes it to ``--out``).

The CPU reference runs in a child process with ``CUDA_VISIBLE_DEVICES=""``: on a CUDA machine a
CPU forward of megatron modules is not possible in a process that sees the GPU (RotaryEmbedding
moves its ``inv_freq`` to ``torch.cuda.current_device()`` on first use, megatron builds default
masks with ``device="cuda"``), while a process without CUDA applies megaloop's CPU compatibility
layer, exactly as on a CPU-only machine. The child builds the model (weights initialised on the
CPU from the seed), computes the reference logits and saves them with the state dict; this
process loads that state dict into the same model, moves it to the GPU and compares. Without
CUDA (the script's CPU smoke mode) the second pass runs on the CPU as well (``.cuda()`` is a
no-op under the compatibility layer): the same code, comparing CPU with CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def build(args):
    from megaloop.model.config import ModelConfig
    from megaloop.model.looped import LoopedGPT
    from megaloop.model.specs import transformer_config
    from megaloop.runtime.parallel import ParallelDims, init_distributed

    init_distributed(ParallelDims(world=1), seed=0)
    cfg = ModelConfig(hidden_size=args.hidden, num_heads=args.heads, seq_len=args.seq, transformer_impl="local")
    tc = transformer_config(cfg, tp=1, pp=1, vpp=None, sequence_parallel=False)
    model = LoopedGPT(cfg, tc, vocab_size=args.vocab, seed=0).eval()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    return model, ids


def reference(args) -> None:
    """Child process (no CUDA visible): CPU FP32 logits and the weights that produced them."""
    assert not torch.cuda.is_available(), "the reference pass must not see a CUDA device"
    model, ids = build(args)
    with torch.no_grad():
        ref = model(ids, depth=args.depth).float()
    torch.save({"state": model.state_dict(), "ids": ids, "ref": ref}, args.reference)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="also write the JSON result here")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--reference", default=None, help=argparse.SUPPRESS)  # internal: child mode
    args = p.parse_args()
    if args.reference:
        reference(args)
        return

    with tempfile.TemporaryDirectory() as tmp:
        ref_file = os.path.join(tmp, "reference.pt")
        cmd = [sys.executable, __file__, "--reference", ref_file,
               *[f"--{k}={getattr(args, k)}" for k in ("hidden", "heads", "seq", "vocab", "batch", "depth")]]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"logits_check: the CPU reference process failed (exit {proc.returncode})")
        saved = torch.load(ref_file, weights_only=False)  # our own file; may hold non-tensor extra state

    # TF32 would make the "FP32" comparison a TF32 one
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, ids = build(args)
    model.load_state_dict(saved["state"])
    ref = saved["ref"]
    assert torch.equal(ids, saved["ids"])
    with torch.no_grad():
        model = model.cuda()
        gpu = model(ids.cuda(), depth=args.depth).float().cpu()
        scale = ref.abs().max().item()
        out = {"fp32_max_abs_err": (gpu - ref).abs().max().item(), "logit_scale": scale}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf = model(ids.cuda(), depth=args.depth).float().cpu()
        out["bf16_autocast_max_abs_err"] = (bf - ref).abs().max().item()
    out["fp32_ok"] = out["fp32_max_abs_err"] <= 1e-3 * max(1.0, scale)
    out["finite"] = bool(torch.isfinite(gpu).all() and torch.isfinite(bf).all())
    out["shape"] = {k: getattr(args, k) for k in ("hidden", "heads", "seq", "vocab", "batch", "depth")}
    out["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    if not out["fp32_ok"] or not out["finite"]:
        raise SystemExit("logits_check: GPU FP32 logits differ from the CPU reference")


if __name__ == "__main__":
    main()
