"""TP=1 logits on the GPU (FP32 and bf16) vs the CPU FP32 reference of the same weights.

Part of tools/gpu_check.sh; prints JSON. The CPU reference runs in this process first (local
spec); the GPU pass uses the same layer spec so only the device differs.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    from megaloop.model.config import ModelConfig
    from megaloop.model.looped import LoopedGPT
    from megaloop.model.specs import transformer_config
    from megaloop.runtime.parallel import ParallelDims, init_distributed

    init_distributed(ParallelDims(world=1), seed=0)
    cfg = ModelConfig(hidden_size=512, num_heads=8, seq_len=256, transformer_impl="local")
    tc = transformer_config(cfg, tp=1, pp=1, vpp=None, sequence_parallel=False)
    model = LoopedGPT(cfg, tc, vocab_size=8192, seed=0).eval()
    ids = torch.randint(0, 8192, (2, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids, depth=5).float()
        model = model.cuda()
        gpu = model(ids.cuda(), depth=5).float().cpu()
        scale = ref.abs().max().item()
        out = {"fp32_max_abs_err": (gpu - ref).abs().max().item(), "logit_scale": scale}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf = model(ids.cuda(), depth=5).float().cpu()
        out["bf16_autocast_max_abs_err"] = (bf - ref).abs().max().item()
    out["fp32_ok"] = out["fp32_max_abs_err"] <= 1e-3 * max(1.0, scale)
    print(json.dumps(out))
    if not out["fp32_ok"]:
        raise SystemExit("GPU FP32 logits differ from the CPU reference")


if __name__ == "__main__":
    main()
