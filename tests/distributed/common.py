"""Shared helpers for torchrun workers (run as scripts, not collected by pytest)."""

from __future__ import annotations

import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def init_world() -> tuple[int, int]:
    from megaloop.runtime.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def set_layout(tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234) -> None:
    from megatron.core import parallel_state, tensor_parallel

    from megaloop.runtime.parallel import seed_everything

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    seed_everything(seed)


def gather_tp(t: torch.Tensor, param: torch.nn.Parameter | None = None, dim: int | None = None) -> torch.Tensor:
    """Full tensor of a TP-sharded parameter/gradient (honours megatron's partition stride)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if param is not None:
        if not getattr(param, "tensor_model_parallel", False) or tp == 1:
            return t.detach().clone()
        dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    else:
        stride = 1
    if tp == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    torch.distributed.all_gather(parts, t.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    if stride == 1:
        return torch.cat(parts, dim=dim)
    pieces = [p.chunk(stride, dim=dim) for p in parts]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(tp)], dim=dim)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / max(a.norm(), 1e-30))


def check(cond: bool, msg: str) -> None:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if not cond:
        raise AssertionError(f"[rank {rank}] {msg}")
