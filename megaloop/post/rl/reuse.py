"""Endpoint-reuse gradients for looped models (SPEC §9, paper Algorithm 1) and the comparison arms.

Let ``F_θ(z; e)`` be one recurrence, ``z^R`` the endpoint a rollout reached, ``ℓ`` a loss of the
logits ``readout(z)``. Near a fixed point the loss gradient is ``G = c + D_⋆ᵀ g`` with
``D_⋆ = (I − J)⁻¹ B`` (``J = ∂F/∂z``, ``B = ∂F/∂θ``, both at the endpoint), whose truncated
Neumann series is evaluated with one recorded recurrence:

    z̄  = stopgrad(z^R);   z' = F_θ(z̄; e)          (e = prelude(x) keeps its graph)
    g  = ∂ℓ(readout(z'))/∂z',   c = direct gradient of ℓ (coda, norm, head; tied embedding)
    v ← g;  repeat b−1 times: v ← g + Jᵀ v         (Neumann-(b−1); Jᵀv = VJP of z' w.r.t. z̄)
    ∇θ  = c + Bᵀ v                                (one VJP of z' w.r.t. θ: core, injection, and
                                                    through e the prelude and embedding)

so ``v = Σ_{k<b} (Jᵀ)ᵏ g`` and ``∇θ = c + D_bᵀ g`` with ``D_b = Σ_{k<b} Jᵏ B``, whose bias
``J^b D_⋆`` decays geometrically. Only one recurrence (plus prelude and readout) is ever
recorded, so the update's memory and compute do not depend on ``R``.

Arms (all accumulate into ``param.grad`` and return a :class:`GradStats`):

* :func:`reuse_backward` — the above from a saved endpoint;
* :func:`recompute_backward` — rerun the ``R`` recurrences without gradient to rebuild ``z^R``,
  then the same Neumann backward;
* :func:`bptt_backward` — full backpropagation through all ``R`` recurrences (``bptt_window=b``
  gives SPEC §3's truncated BPTT instead).

The loss is any ``loss_fn(logits) -> scalar`` (a policy-gradient surrogate, CE, ...).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from megaloop.post.rl.parts import LoopedParts

LossFn = Callable[[torch.Tensor], torch.Tensor]
ARMS = ("reuse", "recompute", "bptt")


@dataclass
class GradStats:
    arm: str
    loss: float
    seconds: float
    depth: int | None = None  # recurrences run (forward) for this update; None for reuse
    backprop: int | None = None  # b: Neumann terms (reuse/recompute) or BPTT window
    residual: float | None = None  # ‖F(z̄) − z̄‖ / ‖z̄‖ at the endpoint (reuse/recompute)
    neumann_growth: float | None = None  # ‖v_b‖ / ‖g‖ (≈ 1/(1−‖J‖) when converged)

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def endpoint(parts: LoopedParts, inputs: Any, depth: int) -> torch.Tensor:
    """``z^R``: ``depth`` recurrences from ``init_state(prelude(inputs))``, without gradient."""
    e = parts.encode(inputs)
    z = parts.init_state(e)
    for _ in range(depth):
        z = parts.step(z, e)
    return z


def reuse_backward(parts: LoopedParts, inputs: Any, z_end: torch.Tensor, loss_fn: LossFn, b: int,
                   *, arm: str = "reuse") -> GradStats:
    """Neumann-(b−1) endpoint-reuse gradient of ``loss_fn(readout(F(stopgrad(z_end))))``,
    accumulated into ``.grad`` of ``parts.parameters()``. ``b = 1`` keeps only ``c + Bᵀ g``."""
    if b < 1:
        raise ValueError(f"b must be >= 1 (Neumann-(b-1)), got {b}")
    t0 = time.perf_counter()
    params = parts.parameters()
    e = parts.encode(inputs)
    z_bar = z_end.detach().to(e.dtype).requires_grad_(True)
    z1 = parts.step(z_bar, e)
    z1_leaf = z1.detach().requires_grad_(True)
    loss = loss_fn(parts.readout(z1_leaf))
    loss.backward()  # c into param.grad (readout paths), g into z1_leaf.grad
    g = z1_leaf.grad
    if g is None:
        raise RuntimeError("the loss does not depend on the recurrent state")
    v = g
    for _ in range(b - 1):
        (jtv,) = torch.autograd.grad(z1, z_bar, v, retain_graph=True)
        v = g + jtv
    torch.autograd.backward(z1, v, inputs=params)  # Bᵀ v (core, injection, prelude via e)
    with torch.no_grad():
        residual = float((z1 - z_bar).float().norm() / z_bar.float().norm().clamp_min(1e-30))
        growth = float(v.float().norm() / g.float().norm().clamp_min(1e-30))
    return GradStats(arm=arm, loss=float(loss.detach()), seconds=time.perf_counter() - t0,
                     backprop=b, residual=residual, neumann_growth=growth)


def recompute_backward(parts: LoopedParts, inputs: Any, depth: int, loss_fn: LossFn, b: int) -> GradStats:
    """Rebuild ``z^R`` with ``depth`` no-grad recurrences, then :func:`reuse_backward`."""
    t0 = time.perf_counter()
    z_end = endpoint(parts, inputs, depth)
    stats = reuse_backward(parts, inputs, z_end, loss_fn, b, arm="recompute")
    stats.seconds = time.perf_counter() - t0
    stats.depth = depth
    return stats


def bptt_backward(parts: LoopedParts, inputs: Any, depth: int, loss_fn: LossFn,
                  bptt_window: int | None = None) -> GradStats:
    """Backpropagation through all ``depth`` recurrences (``bptt_window``: only the last ``bptt_window``,
    the state detached before them; the prelude still learns through ``e``)."""
    t0 = time.perf_counter()
    window = depth if bptt_window is None else max(1, min(bptt_window, depth))
    e = parts.encode(inputs)
    z = parts.init_state(e)
    for r in range(depth):
        if r < depth - window:
            with torch.no_grad():
                z = parts.step(z, e)
            continue
        if r == depth - window and r > 0:
            z = z.detach()
        z = parts.step(z, e)
    loss = loss_fn(parts.readout(z))
    loss.backward()
    return GradStats(arm="bptt", loss=float(loss.detach()), seconds=time.perf_counter() - t0,
                     depth=depth, backprop=window)


def backward(arm: str, parts: LoopedParts, inputs: Any, loss_fn: LossFn, *, depth: int, b: int,
             z_end: torch.Tensor | None = None, bptt_window: int | None = None) -> GradStats:
    """Dispatch to one arm: ``reuse`` (needs ``z_end``), ``recompute`` or ``bptt``."""
    if arm == "reuse":
        if z_end is None:
            raise ValueError("arm 'reuse' needs the saved endpoint z_end")
        return reuse_backward(parts, inputs, z_end, loss_fn, b)
    if arm == "recompute":
        return recompute_backward(parts, inputs, depth, loss_fn, b)
    if arm == "bptt":
        return bptt_backward(parts, inputs, depth, loss_fn, bptt_window)
    raise ValueError(f"unknown arm {arm!r}; one of {ARMS}")


class SavedTensorMeter:
    """Context manager counting the bytes autograd saves for backward inside it (each storage
    once) — the activation memory an update holds between its forward and backward."""

    def __init__(self, exclude: list[torch.Tensor] | None = None):
        self._seen: set = set()
        self._skip = {(p.untyped_storage().data_ptr()) for p in (exclude or [])}
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if key not in self._seen and st.data_ptr() not in self._skip:
            self._seen.add(key)
            self.bytes += st.nbytes()
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def flat_grad(params: list[torch.Tensor]) -> torch.Tensor:
    """All ``.grad`` s as one FP64 vector (missing grads as zeros)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).double()
                      for p in params])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-300))
