"""Write megaloop checkpoints at TP=2 and at PP=2 for the HF conversion tests (2 gloo ranks).

torchrun --nproc_per_node 2 tests/distributed/hf_tp2_ckpt_worker.py OUT_DIR

Both models have QK biases (split over TP with the heads), the readout C and the final norm on the
state (last PP stage).
OUT_DIR/tp2/checkpoints/step_00000001: TP=2 model (parcae_decay, GQA 2 groups), every parameter
perturbed (per-rank noise on TP shards); OUT_DIR/tp2/logits.pt: its eval-mode logits at depth 5 on
OUT_DIR/tp2/ids.pt (gathered over TP). OUT_DIR/pp2/checkpoints/step_00000001: PP=2 model
(huginn_linear) with name-seeded perturbations (reproducible at TP=1 by `perturb`).
"""

import sys

import common  # noqa: F401  (sets sys.path, silences warnings)
import torch
from common import gather_tp, init_world, set_layout

from megaloop.config import ParallelConfig, RunConfig
from megaloop.data.config import DataConfig
from megaloop.model.build import build_model
from megaloop.model.config import ModelConfig
from megaloop.runtime.parallel import stable_seed
from megaloop.train.checkpoint import CheckpointManager

SEED = 7
NO_DATA = DataConfig(path="/nonexistent/hf-test-data")  # no tokenizer to find: model-only export


def model_cfg(injection: str) -> ModelConfig:
    return ModelConfig(hidden_size=64, num_heads=4, num_query_groups=2, seq_len=32, vocab_size=250,
                       injection=injection, state_init_std=0.5, qk_bias=True, state_readout=True,
                       state_final_norm=True)


@torch.no_grad()
def perturb(model, tp_rank: int = 0, scale: float = 0.05) -> None:
    """Name-seeded noise (plus the TP rank for TP-sharded tensors)."""
    for name, p in model.named_parameters():
        sharded = getattr(p, "tensor_model_parallel", False)
        g = torch.Generator().manual_seed(stable_seed("hf-test", name, tp_rank if sharded else 0))
        p.add_(scale * torch.randn(p.shape, generator=g))


def main():
    out = sys.argv[1]
    rank, world = init_world()
    from megatron.core import parallel_state

    # ---- TP=2
    set_layout(tp=2, seed=SEED)
    cfg = model_cfg("parcae_decay")
    chunks, _ = build_model(cfg, vocab_size=250, tp=2, pp=1, vpp=None, sequence_parallel=False, seed=SEED, ddp=False)
    perturb(chunks[0], parallel_state.get_tensor_model_parallel_rank())
    chunks[0].eval()
    ids = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = gather_tp(chunks[0](ids, depth=5), dim=-1)
    run = RunConfig(model=cfg, parallel=ParallelConfig(tp=2), data=NO_DATA)
    CheckpointManager(f"{out}/tp2/checkpoints").save(1, chunks, None, common={"step": 1, "config": run.to_dict()})
    if rank == 0:
        torch.save(ids, f"{out}/tp2/ids.pt")
        torch.save(logits, f"{out}/tp2/logits.pt")
    # ---- PP=2
    set_layout(pp=2, seed=SEED)
    cfg = model_cfg("huginn_linear")
    chunks, _ = build_model(cfg, vocab_size=250, tp=1, pp=2, vpp=None, sequence_parallel=False, seed=SEED, ddp=False)
    perturb(chunks[0])
    run = RunConfig(model=cfg, parallel=ParallelConfig(pp=2), data=NO_DATA)
    CheckpointManager(f"{out}/pp2/checkpoints").save(1, chunks, None, common={"step": 1, "config": run.to_dict()})
    torch.distributed.barrier()
    if rank == 0:
        print("CKPT OK", flush=True)


if __name__ == "__main__":
    main()
