"""One optimizer interface for the post-training loops: plain AdamW in one process, or DeepSpeed ZeRO.

Both engines expose the same operations, so ``GRPOTrainer`` and ``train_student`` run unchanged:

* ``compute_module`` — the module the loop calls for rollouts and custom gradients. For
  :class:`PlainEngine` it is the model itself. For :class:`DeepSpeedEngine` at ZeRO ≤ 2 it is a
  *shadow*: the same module structure whose parameters are new ``nn.Parameter`` objects over the
  engine's own parameter storage (no copy: updates by the engine are visible at once), so autograd
  on it (the reuse arm's Neumann VJPs, several backward passes per step) never fires DeepSpeed's
  gradient hooks;
* ``apply_grads(scale)`` — the gradients accumulated in ``compute_module``'s ``.grad`` become
  one optimizer step. DeepSpeed receives them through the linear surrogate
  ``scale · Σ_p ⟨p, stopgrad(g_p)⟩`` whose gradient is ``scale · g_p``: one ``engine.backward`` with
  the same graph on every rank (so ZeRO's reduce order matches), then ``engine.step``. DeepSpeed
  averages over ranks, so a loop whose local losses are normalised by the *global* count passes
  ``scale = world``;
* ``backward(loss)`` / ``step()`` — the ordinary path (distillation; ZeRO-3 included), and
  ``forward`` — the callable for the ordinary path's forward (the DeepSpeed engine itself);
* ``set_lr``, ``grad_norm`` (pre-clip global norm of the last step), ``save`` / ``load``
  (DeepSpeed checkpoints, or ``plain.pt`` for one process; ``latest`` names the last tag; a ZeRO-1/2/3
  checkpoint of another process count loads through DeepSpeed's universal checkpoint,
  :mod:`megaloop.post.universal`; a checkpoint
  of another model shape is refused in one line, :class:`CheckpointMismatch`) and
  ``full_state_dict()`` (ZeRO-3 parameters gathered; every rank must call it).
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from megaloop.config_utils import ConfigError
from megaloop.runtime.agree import on_every_rank
from megaloop.runtime.parallel import comm_device


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0


def launched_world() -> int:
    """Processes of this launch (torchrun / the deepspeed launcher set ``WORLD_SIZE``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def dist_info() -> DistInfo:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return DistInfo(torch.distributed.get_rank(), torch.distributed.get_world_size(),
                        int(os.environ.get("LOCAL_RANK", "0")))
    return DistInfo()


def init_post_distributed(device: str, deepspeed_config: str | None) -> tuple[DistInfo, str]:
    """Join the launch's process group (gloo on CPU, NCCL on GPU) through DeepSpeed.

    Several processes need ``--deepspeed`` (else each would train alone and write the same
    output). Returns ``(DistInfo, device)`` with ``device`` the rank's own GPU on CUDA."""
    world = launched_world()
    if deepspeed_config is None:
        if world > 1:
            raise ConfigError(f"--deepspeed: required when launched on {world} processes "
                              "(e.g. --deepspeed zero2)")
        return DistInfo(), device
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if device == "cpu" else "cuda")
    import deepspeed

    if "RANK" not in os.environ:  # one process started without a launcher: a world of one
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl")
    return dist_info(), device


def all_gather_cat(t: torch.Tensor, world: int) -> torch.Tensor:
    """Concatenate equal-shaped ``t`` of the ``world`` ranks in rank order (identity for ``world=1``,
    e.g. a single-process engine inside a launched job); on ``t``'s device."""
    if world == 1:
        return t
    x = t.contiguous().to(comm_device())
    parts = [torch.empty_like(x) for _ in range(world)]
    torch.distributed.all_gather(parts, x)
    return torch.cat(parts).to(t.device)


def all_reduce_sum(values: list[float], world: int) -> list[float]:
    """Sum of each value over the ``world`` ranks (FP64; identity for ``world=1``)."""
    if world == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    torch.distributed.all_reduce(t)
    return t.tolist()


def shadow_module(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters share storage with ``module``'s (new objects)."""
    memo = {id(p): nn.Parameter(p.data, requires_grad=p.requires_grad) for p in module.parameters()}
    return copy.deepcopy(module, memo)


class PostEngine(Protocol):
    world: int
    rank: int
    stage: int | None
    grad_norm: float | None

    @property
    def compute_module(self) -> nn.Module: ...

    @property
    def forward(self): ...

    def apply_grads(self, scale: float = 1.0) -> float | None: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> float | None: ...

    def set_lr(self, lr: float) -> None: ...

    def save(self, directory: str | Path, tag: str, client_state: dict) -> None: ...

    def load(self, directory: str | Path, tag: str | None = None) -> dict | None: ...

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...


def _latest(directory: Path, tag: str | None) -> str | None:
    """``tag``, else the tag ``directory/latest`` names (None without one); ConfigError when the
    named checkpoint folder is missing (deleted or moved by hand): :func:`megaloop.post.runs.resume_tag`."""
    if tag is not None or not (directory / "latest").is_file():
        return tag
    from megaloop.post.runs import resume_tag

    return resume_tag(directory)


class CheckpointMismatch(ConfigError):
    """A checkpoint in ``where`` whose weights do not fit the model being trained (another shape);
    ``detail``: the first mismatch torch names (``size mismatch for ...``), without its final dot."""

    def __init__(self, where: Path, detail: str):
        self.where, self.detail = where, detail
        super().__init__(f"--resume: the checkpoint in {where} does not fit the model being trained (another "
                         f"model shape: {detail}); resume with the model it was trained from")


@contextlib.contextmanager
def _weights_fit(where: Path):
    """Turn ``load_state_dict``'s error for weights of another shape (or other names) into one line:
    :class:`CheckpointMismatch`, not a traceback of one line per tensor."""
    try:
        yield
    except RuntimeError as err:
        text = str(err)
        if not any(w in text for w in ("size mismatch", "Missing key", "Unexpected key")):
            raise
        first = next((line.strip() for line in text.splitlines() if "size mismatch" in line), text.splitlines()[0])
        raise CheckpointMismatch(where, first.rstrip(".")) from None


class PlainEngine:
    """One process: ``torch.optim.AdamW`` with global-norm clipping (the pre-DeepSpeed behaviour)."""

    world, rank, stage = 1, 0, None

    def __init__(self, module: nn.Module, *, lr: float, betas=(0.9, 0.95), weight_decay: float = 0.0,
                 clip_grad: float | None = 1.0):
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        self.clip_grad = clip_grad
        self.grad_norm: float | None = None

    @property
    def compute_module(self) -> nn.Module:
        return self.module

    @property
    def forward(self):
        return self.module

    def apply_grads(self, scale: float = 1.0) -> float | None:
        if scale != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        return self.step()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float | None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            self.grad_norm = None
            return None
        if self.clip_grad:
            self.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad))
        else:
            self.grad_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return self.grad_norm

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def save(self, directory: str | Path, tag: str, client_state: dict) -> None:
        from megaloop.runtime.files import atomic_write_file, atomic_write_text

        d = Path(directory)
        (d / tag).mkdir(parents=True, exist_ok=True)
        for stale in d.glob("*/.plain.pt.*.tmp"):  # a save killed mid-write (SIGKILL skips the clean-up): 6 MB
            stale.unlink(missing_ok=True)  # each at tiny, never removed; one run writes an --out at a time
        state = {"module": self.module.state_dict(), "optimizer": self.opt.state_dict(), "client_state": client_state}
        atomic_write_file(d / tag / "plain.pt", lambda tmp: torch.save(state, tmp))  # no torn file on a kill
        atomic_write_text(d / "latest", tag)

    def load(self, directory: str | Path, tag: str | None = None) -> dict | None:
        d = Path(directory)
        tag = _latest(d, tag)
        if tag is None:
            return None
        path = d / tag / "plain.pt"
        if not path.is_file():
            raise ConfigError(f"--resume: {path} is not a single-process checkpoint (saved under DeepSpeed? "
                              "resume with the same --deepspeed)")
        state = torch.load(path, map_location="cpu", weights_only=False)
        with _weights_fit(d):
            self.module.load_state_dict(state["module"])
        self.opt.load_state_dict(state["optimizer"])
        return state["client_state"]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items()}


class DeepSpeedEngine:
    """``deepspeed.initialize`` over ``module`` with a client AdamW (``config`` from
    :func:`megaloop.post.ds_config.load_ds_config`)."""

    def __init__(self, module: nn.Module, config: dict, *, lr: float, betas=(0.9, 0.95), weight_decay: float = 0.0):
        import deepspeed

        params = [p for p in module.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=config)
        self.stage = int(self.engine.zero_optimization_stage())
        if self.stage >= 3:
            # parameters a module uses outside its submodules' forward (e.g. injection.prepare/exit)
            # must be gathered by the root's forward
            for p in getattr(module, "zero3_external_parameters", lambda: [])():
                deepspeed.zero.register_external_parameter(module, p)
        self.world = torch.distributed.get_world_size()
        self.rank = torch.distributed.get_rank()
        self.grad_norm: float | None = None
        self._shadow: nn.Module | None = None

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @property
    def compute_module(self) -> nn.Module:
        if self.stage >= 3:
            raise ConfigError("zero_optimization.stage: 3 partitions the parameters; this loop needs whole "
                              "parameters for its own autograd (use ZeRO-1 or ZeRO-2)")
        if self._shadow is None:
            self._shadow = shadow_module(self.engine.module)
        return self._shadow

    @property
    def forward(self):
        return self.engine

    def apply_grads(self, scale: float = 1.0) -> float | None:
        shadow = self.compute_module
        surrogate = None
        for p, s in zip(self.engine.module.parameters(), shadow.parameters()):
            if not p.requires_grad:
                continue
            g = s.grad if s.grad is not None else torch.zeros_like(s)
            term = (p * g.detach().to(p.dtype)).sum()
            surrogate = term if surrogate is None else surrogate + term
            s.grad = None
        assert surrogate is not None, "no trainable parameters"
        self.engine.backward(surrogate * scale)
        return self.step()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> float | None:
        self.engine.step()
        gn = self.engine.get_global_grad_norm()
        self.grad_norm = None if gn is None else float(gn)
        return self.grad_norm

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def save(self, directory: str | Path, tag: str, client_state: dict) -> None:
        self.engine.save_checkpoint(str(directory), tag=tag, client_state=client_state)

    def load(self, directory: str | Path, tag: str | None = None) -> dict | None:
        d = Path(directory)
        tag = _latest(d, tag)
        if tag is None:
            return None
        if not (d / tag).is_dir() or (d / tag / "plain.pt").is_file():
            raise ConfigError(f"--resume: {d / tag} is not a DeepSpeed checkpoint")
        from megaloop.post.runs import saved_world

        saved = (saved_world(d / tag) or ("deepspeed", 0))[1]
        load_dir, universal = d, saved > 0 and saved != self.world
        if universal:  # another process count: through DeepSpeed's universal checkpoint (ZeRO-1/2/3)
            from megaloop.post.universal import universal_checkpoint

            load_dir = universal_checkpoint(d, tag, rank=self.rank, world=self.world)
            if self.rank == 0:
                print(f"--resume: {d / tag} (saved with {saved} process{'es' if saved != 1 else ''}) converted "
                      f"for {self.world} process{'es' if self.world != 1 else ''} through DeepSpeed's universal "
                      f"checkpoint ({load_dir})", flush=True)
        cfg = self.engine._config
        before = cfg.load_universal_checkpoint
        cfg.load_universal_checkpoint = universal or before
        loaded: list = []

        def load() -> None:
            try:
                with _weights_fit(d):
                    loaded.extend(self.engine.load_checkpoint(str(load_dir), tag=tag))
            except (RuntimeError, EOFError, FileNotFoundError, pickle.UnpicklingError) as err:
                first = (str(err).strip().splitlines() or [""])[0][:200]
                if isinstance(err, RuntimeError) and "PytorchStreamReader" not in first:
                    raise  # not a damaged file (out of memory, a failed collective, ...)
                raise ConfigError(f"--resume: {d / tag} cannot be loaded, a file of it is damaged or missing "
                                  f"({type(err).__name__}: {first}); move it aside and write an earlier step's "
                                  f"name into {d / 'latest'} to resume from that one") from None

        try:
            # a shard damaged on one rank fails there alone: under ZeRO-1/2 every rank then raises the one
            # line; ZeRO-3 and the universal path run collectives inside the load, which the failed rank
            # would never join, so there it exits alone (one line) and the launcher stops the others
            if self.stage in (1, 2) and not universal:
                on_every_rank(load)
            else:
                load()
        finally:
            cfg.load_universal_checkpoint = before
        path, client = loaded
        if path is None:
            raise ConfigError(f"--resume: DeepSpeed could not load {d / tag}")
        self._shadow = None  # loading may rebind parameter storage
        return client

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        module = self.engine.module
        if self.stage < 3:
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def make_engine(module: nn.Module, ds_config: dict | None, *, lr: float, betas=(0.9, 0.95),
                weight_decay: float = 0.0, clip_grad: float | None = 1.0) -> PostEngine:
    """:class:`DeepSpeedEngine` when a config is given, else :class:`PlainEngine`."""
    if ds_config is None:
        return PlainEngine(module, lr=lr, betas=betas, weight_decay=weight_decay, clip_grad=clip_grad)
    return DeepSpeedEngine(module, ds_config, lr=lr, betas=betas, weight_decay=weight_decay)
