"""Writes a tiny native megaloop run (not collected by pytest): ``RUN/tokenizer.json`` (a small BPE
tokenizer) and ``RUN/checkpoints/step_00000003``, as ``megaloop train`` leaves them, and the same
model converted to an HF folder ``HF_DIR``, in one plain process (megatron-core on gloo)::

    python tests/post/native_checkpoint.py RUN_DIR HF_DIR

Run in its own process so the pytest process never starts megatron-core (its CPU layer stays out)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(run: Path, hf: Path) -> None:
    import torch
    from tokenizers import Tokenizer

    from megaloop.config import RunConfig
    from megaloop.hf.convert import convert_to_hf
    from megaloop.model.build import build_model
    from megaloop.model.config import ModelConfig
    from megaloop.runtime.parallel import ParallelDims, init_distributed, stable_seed
    from megaloop.train.checkpoint import CheckpointManager
    from tests.conftest import bpe_tokenizer

    torch.set_num_threads(1)
    init_distributed(ParallelDims(world=1), seed=1234)
    vocab = Tokenizer.from_file(str(bpe_tokenizer(run))).get_vocab_size()
    cfg = ModelConfig(hidden_size=64, num_heads=4, seq_len=32, vocab_size=vocab, state_init_std=0.5)
    chunks, _ = build_model(cfg, vocab_size=vocab, tp=1, pp=1, vpp=None, sequence_parallel=False, seed=5, ddp=False)
    with torch.no_grad():  # away from the initialisation, so the conversion's logit check means something
        for name, p in chunks[0].named_parameters():
            gen = torch.Generator().manual_seed(stable_seed("post-ckpt", name))
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    CheckpointManager(run / "checkpoints").save(3, chunks, None, common={"step": 3, "config": RunConfig(model=cfg).to_dict()})
    convert_to_hf(run / "checkpoints", hf)
    print(f"wrote {run} and {hf}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
