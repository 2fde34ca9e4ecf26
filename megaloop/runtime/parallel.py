"""Process groups, validated parallel degrees, and seeding.

``init_distributed`` starts torch.distributed (``nccl`` with CUDA, ``gloo`` without; a
single process needs no launcher), applies the CPU compatibility layer when CUDA is absent,
and initialises megatron-core's model-parallel groups from a validated :class:`ParallelDims`.
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass

import numpy as np
import torch

from megaloop.config_utils import ConfigError
from megaloop.runtime.cpu_compat import apply_cpu_compat


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees. ``world = tp * pp * dp``; ``vpp`` = model chunks per pipeline rank."""

    world: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None

    def __post_init__(self) -> None:
        for name in ("world", "tp", "pp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"parallel.{name}: must be a positive integer, got {v!r}")
        if self.world % (self.tp * self.pp):
            raise ConfigError(
                f"parallel: world size {self.world} is not divisible by tp*pp = "
                f"{self.tp}*{self.pp} = {self.tp * self.pp}"
            )
        if self.vpp is not None:
            if self.vpp < 1:
                raise ConfigError(f"parallel.vpp: must be >= 1 or null, got {self.vpp}")
            if self.vpp > 1 and self.pp < 2:
                raise ConfigError("parallel.vpp: interleaved schedules need parallel.pp >= 2")

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MEGATRON_SEED_LIMIT = 2 ** 64 - 2 ** 16  # room for megatron's +2718 (+ TP / expert rank) seed offsets


def init_distributed(dims: ParallelDims, seed: int, timeout_s: int = 600) -> None:
    """Start torch.distributed and megatron-core's groups for ``dims``; seed every RNG.

    Works under torchrun/srun (reads RANK/WORLD_SIZE/MASTER_ADDR) and in a single plain
    process (sets up a 1-rank group on a free local port).
    """
    from megatron.core import parallel_state, tensor_parallel

    cuda = torch.cuda.is_available()
    if not cuda:
        apply_cpu_compat()
    if not torch.distributed.is_initialized():
        backend = "nccl" if cuda else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" in os.environ:  # torchrun / srun
            torch.distributed.init_process_group(backend=backend, timeout=timeout)
        else:  # a plain single process; the environment is left untouched for child processes
            torch.distributed.init_process_group(
                backend=backend, timeout=timeout, rank=0, world_size=1,
                init_method=f"tcp://127.0.0.1:{_free_port()}")
    world = torch.distributed.get_world_size()
    if world != dims.world:
        raise ConfigError(f"parallel: launched with {world} processes but config expects {dims.world}")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=dims.tp,
            pipeline_model_parallel_size=dims.pp,
            virtual_pipeline_model_parallel_size=dims.vpp if (dims.vpp or 1) > 1 else None,
        )
    seed_everything(seed)
    # megatron seeds its model-parallel streams at seed + 2718 + rank offsets, which overflowed a 64-bit
    # seed for the top of the range train.seed takes ([0, 2**64)): those seeds wrap (nothing else changes)
    tensor_parallel.model_parallel_cuda_manual_seed(seed % MEGATRON_SEED_LIMIT)
    # model_parallel_cuda_manual_seed re-seeds the (redirected) default generator with a
    # per-stage offset; layouts must not change initial weights, so restore the plain seed.
    seed_everything(seed)


def compute_device() -> torch.device:
    """Where this rank's model, batches and collective buffers live: its CUDA device when CUDA is
    present (NCCL needs device tensors), else the CPU (gloo)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def comm_device() -> torch.device:
    """Where a collective's tensors must live under the initialised group: this rank's GPU under NCCL
    (which has no CPU tensors: "No backend type associated with device type cpu"), else the CPU
    (gloo; also a CPU run on a machine that has CUDA, unlike :func:`compute_device`)."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "remote process exited or there was a network error")  # gloo's and NCCL's words for it
BACKEND = ("gloo", "NCCL", "ProcessGroup")  # in the message of a collective's error (gloo's: its pair.cc path)


def peer_lost_line(err: BaseException) -> str | None:
    """The one line for this rank when ``err`` is a collective that failed because another rank of the
    job ended first (its own output says why): it was a gloo traceback on every surviving rank, which
    torchrun could name as the root cause; None for any other error (a reset download, a closed pipe
    of this rank's own: their traceback stays), and in a one-process world."""
    text = str(err)
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
            and any(w in text for w in PEER_LOST) and any(b in text for b in BACKEND)):
        return None
    rank = torch.distributed.get_rank()
    first = str(err).strip().splitlines()[0][:200]
    return (f"megaloop: stopped (rank {rank}): another rank of the job ended first and this rank's collective "
            f"failed ({type(err).__name__}: {first}); that rank's own error, above or in its log, says why")


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from a tuple of ints/strings, identical on every rank and run."""
    import hashlib

    h = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)
