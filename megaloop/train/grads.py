"""Gradient finalisation: core-replica sync over the pipeline, then megatron's finalize.

Every pipeline stage (and virtual stage) holds a replica of the shared core. Their gradients are
summed over all replicas *before* megatron's data-parallel reduction, while each rank's grad
buffers still hold full local gradients (so it also holds with the distributed optimizer), and
every replica then applies the same update.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megaloop.model.build import unwrap


def _grad(p: torch.nn.Parameter) -> torch.Tensor | None:
    return p.main_grad if hasattr(p, "main_grad") else p.grad


def sync_core_replica_grads(model_chunks: list[torch.nn.Module]) -> None:
    """Sum core-replica gradients over the model chunks of this rank and the pipeline group."""
    per_chunk = [unwrap(m).core_replica_params() for m in model_chunks]
    if not per_chunk or not per_chunk[0]:
        return
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 1 and len(per_chunk) == 1:
        return
    grads = []
    for i, p in enumerate(per_chunk[0]):
        g = _grad(p).clone() if _grad(p) is not None else torch.zeros_like(p, dtype=torch.float32)
        for other in per_chunk[1:]:
            go = _grad(other[i])
            if go is not None:
                g.add_(go)
        grads.append(g)
    flat = _flatten_dense_tensors(grads)
    if pp > 1:
        torch.distributed.all_reduce(flat, group=parallel_state.get_pipeline_model_parallel_group())
    for chunk_params in per_chunk:
        for p, g in zip(chunk_params, _unflatten_dense_tensors(flat, grads)):
            tgt = _grad(p)
            if tgt is None:
                p.grad = g.to(p.dtype).clone()
            else:
                tgt.copy_(g)


def finalize_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """Drop-in for ``TransformerConfig.finalize_model_grads_func``."""
    sync_core_replica_grads(model)
    return finalize_model_grads(model, num_tokens, pg_collection=pg_collection,
                                force_all_reduce=force_all_reduce)


def grads_finite(model_chunks: list[torch.nn.Module]) -> bool:
    """Whether the step's gradient is finite everywhere, the same answer on every rank (one MAX
    all-reduce over the world). Read from each rank's grad buffers after megatron's finalize: a
    non-finite value in any rank's local or reduced gradient makes the reduced gradient non-finite,
    which megatron's FP32 and bf16 optimizers (no loss scaler) would apply, unclipped (a NaN norm
    fails the clip's ``coeff < 1`` test), with a finite loss."""
    flags = []
    for m in model_chunks:
        buffers = [b for name in ("buffers", "expert_parallel_buffers")  # megatron DDP's lists (not Module.buffers)
                   if isinstance(got := getattr(m, name, None), list) for b in got]
        grads = [b.grad_data for b in buffers] or [g for p in m.parameters() if (g := _grad(p)) is not None]
        # one sum per buffer (no buffer-sized mask): NaN and ±inf propagate into it; only a finite
        # gradient whose sum passes 3e38 would read as non-finite, one far past any clip threshold
        flags += [~torch.isfinite(g.sum()) for g in grads if g.numel()]
    device = flags[0].device if flags else next((p.device for m in model_chunks for p in m.parameters()),
                                                torch.device("cpu"))  # the main group's device (NCCL: the GPU)
    bad = (torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool, device=device)).float().reshape(1)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    return not bool(bad.item())
