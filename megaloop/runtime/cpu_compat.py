"""CPU compatibility layer: lets megatron-core's TP/PP/DP, optimizer and checkpoint code run
without CUDA (over gloo). Applied by :func:`apply_cpu_compat` only when CUDA is absent, and
only here: nothing else in megaloop patches torch or megatron.

What megatron-core 0.16.1 does that fails on a CPU-only torch, and how it is redirected:

1. ``torch.cuda.current_device()`` used as a ``device=`` argument (global memory buffer, TP
   mappings, p2p shape exchange, layers' backward) -> returns ``torch.device("cpu")``. This is
   a plain function patch, so it also holds inside autograd's backward.
2. ``torch.cuda.synchronize()`` (p2p, checkpointing) -> no-op.
3. The CUDA RNG tracker (``tensor_parallel.random``) reads/sets the CUDA generator -> redirected
   to the CPU default generator, so ``get_cuda_rng_tracker().fork()`` really forks CPU draws.
4. Literal ``device="cuda"`` in the schedules' token count, optimizer scale tensors, grad
   clipping, the default causal mask; ``tensor.cuda()``; ``pin_memory=True``; and
   ``param.type() == "torch.cuda.FloatTensor"`` checks in grad clipping and the distributed
   optimizer -> a process-wide :class:`torch.overrides.TorchFunctionMode` rewrites CUDA devices
   to CPU, makes ``.cuda()`` a CPU move and reports CPU tensor types with their CUDA names.
   Autograd does not carry a TorchFunctionMode into backward; the megatron backward paths only
   use (1), which is a function patch.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
_LOCK = threading.Lock()
_CPU = torch.device("cpu")


def _is_cuda(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for every torch call made while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        dev = kwargs.get("device")
        if dev is not None and _is_cuda(dev):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


_MODE: CudaToCpuMode | None = None


def without_redirect():
    """Context in which the TorchFunctionMode is popped (a null context when it is not active).

    Every torch call under the mode pays a Python dispatch (about 3x on the tiny config's step),
    so model compute that needs no redirect (the model's forward, given an explicit causal mask)
    runs without it; megatron's schedules, optimizer and checkpointing keep it."""
    from contextlib import nullcontext

    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

    if _MODE is None or _get_current_function_mode() is not _MODE:
        return nullcontext()
    return _pop_mode_temporarily()


def redirect_active() -> bool:
    """Whether the TorchFunctionMode is the innermost mode of this thread."""
    from torch.overrides import _get_current_function_mode

    return _MODE is not None and _get_current_function_mode() is _MODE


def release_redirect() -> None:
    """Exit the TorchFunctionMode (the function redirects stay; the next :func:`apply_cpu_compat`,
    i.e. the next ``init_distributed``, enters the mode again). For a process that used megatron
    only to read a checkpoint and computes with plain PyTorch from then on (eval, generate, rl,
    distill-prefill): under the mode every later torch call pays a Python dispatch (token-by-token
    decoding 1.4x slower on CPU)."""
    global _MODE
    with _LOCK:
        if redirect_active():
            _MODE.__exit__(None, None, None)
            _MODE = None


def apply_cpu_compat(force: bool = False) -> bool:
    """Install the redirects if CUDA is unavailable (or ``force``). Idempotent; returns whether
    the layer is active. Call before building megatron modules."""
    global _APPLIED, _MODE
    with _LOCK:
        if _APPLIED:
            if _MODE is None:  # released by release_redirect: megatron is about to be used again
                _MODE = CudaToCpuMode()
                _MODE.__enter__()
            return True
        if torch.cuda.is_available() and not force:
            return False
        import megatron.core.tensor_parallel.random as mrandom

        torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment]
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
        torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))  # type: ignore[assignment]
        torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
        torch.cuda.set_rng_state = lambda s, *a, **k: torch.set_rng_state(s)  # type: ignore[assignment]
        mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
        mrandom._set_cuda_rng_state = lambda s, *a, **k: torch.set_rng_state(s)
        _MODE = CudaToCpuMode()
        _MODE.__enter__()  # process-wide for this (main) thread; never exited
        _APPLIED = True
        return True
