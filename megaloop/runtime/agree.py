"""One outcome for every rank: a set-up step that fails on some ranks stops all of them alike.

Without it, a rank whose data check or first batch fails exits while the others go on (rank 0 writes
the run directory) and then wait in their next collective until the launcher ends them, with no word
of why. :func:`on_every_rank` runs the step, gathers each rank's failure over a gloo group of its
own with a long timeout (a step such as hashing a share of a large dataset may take longer than the
main group's timeout on some ranks), and raises on every rank the first failure's message, naming
the rank that had it.
"""

from __future__ import annotations

import datetime
import importlib
from typing import Callable, TypeVar

import torch

from megaloop.errors import UserError

T = TypeVar("T")
SETUP_TIMEOUT_S = 6 * 3600  # the gather waits for the slowest rank's step this long


def _user_error_class(module: str, name: str) -> type[UserError]:
    """The :class:`UserError` subclass ``module.name``, else :class:`UserError` itself."""
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return UserError
    return cls if isinstance(cls, type) and issubclass(cls, UserError) else UserError


def on_every_rank(step: Callable[[], None], *, timeout_s: int = SETUP_TIMEOUT_S) -> None:
    """Run ``step()`` on this rank; when it raised a :class:`UserError` on any rank, raise the first
    (lowest rank's) on every rank: the same class and message, with ``(found by rank N)`` added
    when the world has several ranks. A rank whose own ``step`` raised anything else (a bug) raises
    that, with its traceback, after the others learned of it. Collective: every rank must call it."""
    err: BaseException | None = None
    try:
        step()
    except Exception as e:  # noqa: BLE001 - gathered, then re-raised below
        err = e
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        if err is not None:
            raise err
        return
    mine = None if err is None else (type(err).__module__, type(err).__qualname__, str(err),
                                      isinstance(err, UserError))
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        every: list = [None] * world
        dist.all_gather_object(every, mine, group=group)
    finally:
        dist.destroy_process_group(group)
    if err is not None and not isinstance(err, UserError):
        raise err
    failed = [(rank, f) for rank, f in enumerate(every) if f is not None]
    if not failed:
        return
    user = [(rank, f) for rank, f in failed if f[3]]
    rank, (module, name, text, _) = (user or failed)[0]
    if not user:  # only bugs elsewhere: say where, and stop here too
        raise UserError(f"rank {rank} failed during set-up ({name}: {text.splitlines()[0] if text else ''}); "
                        "see its traceback")
    raise _user_error_class(module, name)(f"{text} (found by rank {rank})")



def on_every_rank_each_step(step: Callable[[], T], device: torch.device) -> T:
    """The per-step form of :func:`on_every_rank` for a step's own reads (a batch with a bad token id
    met mid-run on one rank): ``step()``'s result, after one MAX all-reduce of a failure flag on the
    main group; only when some rank's ``step`` raised a :class:`UserError`, :func:`on_every_rank`
    shares its message, so every rank stops with it instead of the others dying in their next
    collective (a gloo traceback, exit 1) or waiting there. Collective: every rank calls it."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return step()
    err: UserError | None = None
    try:
        out = step()
    except UserError as e:
        err = e
    flag = torch.tensor([0.0 if err is None else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        def again() -> None:
            if err is not None:
                raise err

        on_every_rank(again)
    return out
