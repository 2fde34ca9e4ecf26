"""Build the model chunks of this rank (one per virtual pipeline stage), optionally in megatron DDP."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig

from megaloop.model.config import ModelConfig
from megaloop.model.looped import LoopedGPT
from megaloop.model.specs import transformer_config
from megaloop.runtime.parallel import compute_device


def build_model(cfg: ModelConfig, *, vocab_size: int, tp: int, pp: int, vpp: int | None,
                sequence_parallel: bool, seed: int, ddp: bool = True,
                distributed_optimizer: bool = False) -> tuple[list[torch.nn.Module], TransformerConfig]:
    """Model chunks for this rank and their ``TransformerConfig``.

    Chunk ``v`` of pipeline rank ``k`` is virtual stage ``v·pp + k``; the first holds the
    embedding and prelude, the last the coda and head, every one a core replica. With ``ddp``,
    each chunk is wrapped in megatron's DistributedDataParallel (fp32 grad buffers). Weights are
    initialised on the CPU (layout-independent seeds) and then moved to :func:`compute_device`
    before the bf16 wrapper and DDP, as megatron's ``get_model`` does.
    """
    device = compute_device()
    tc = transformer_config(cfg, tp=tp, pp=pp, vpp=vpp, sequence_parallel=sequence_parallel)
    nchunks = vpp or 1
    rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks: list[torch.nn.Module] = []
    for v in range(nchunks):
        pre = rank == 0 and v == 0
        post = rank == pp - 1 and v == nchunks - 1
        m = LoopedGPT(cfg, tc, vocab_size, pre_process=pre, post_process=post,
                      vp_stage=v if nchunks > 1 else None, seed=seed).to(device)
        if cfg.bf16:
            from megatron.core.transformer.module import Float16Module

            m = Float16Module(tc, m)
        chunks.append(m)
    if ddp:
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=distributed_optimizer, check_for_nan_in_grad=False)
        chunks = [DistributedDataParallel(tc, ddp_cfg, m, disable_bucketing=i > 0)
                  for i, m in enumerate(chunks)]
    return chunks, tc


def unwrap(module: torch.nn.Module) -> LoopedGPT:
    """The LoopedGPT inside DDP / Float16Module wrappers."""
    while not isinstance(module, LoopedGPT):
        module = module.module
    return module
