"""Depth-use diagnostics: how much each recurrence changes the state, and how much of the
injection's output comes from the state rather than the input.

For a looped model ``h^{r} = F(Inject(h^{r-1}, e))`` (r = 1..R) the diagnostics per recurrence are

- ``rel_change``: token mean of ‖h^r − h^{r−1}‖ / ‖h^r‖ (norms over channels, per token);
- ``state_share``: token mean of ‖S_r‖ / (‖S_r‖ + ‖I_r‖), where the injection's output splits as
  ``ζ = S_r + I_r`` with ``I_r = Inject(0, e)`` (the input's part, including any bias) and
  ``S_r = Inject(h^{r−1}, e) − Inject(0, e)`` (the state's part; exact for the affine injections,
  the carry-over after the projection for OrthoInj). 1.0 for DEQ-QKV (ζ = h, e enters Q/K/V);
- ``rms_h``: root mean square of h^r over all tokens and channels; ``rms_e`` that of e;
- ``contraction``: ‖h^r − h^{r−1}‖_F / ‖h^{r−1} − h^{r−2}‖_F over the whole batch (r ≥ 2), the
  empirical contraction factor of one more recurrence (< 1: the iteration settles).

Tensors may be [b, s, d] or [s, b, d]; only the last dimension is the channel dimension. ``mask``
(same leading shape, 1 = count the token) restricts the token means and norms to real tokens.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


def _token_norm(x: torch.Tensor) -> torch.Tensor:
    return x.double().norm(dim=-1)


def _mean(x: torch.Tensor, mask: Optional[torch.Tensor]) -> float:
    if mask is None:
        return float(x.mean())
    m = mask.to(x.dtype)
    return float((x * m).sum() / m.sum().clamp_min(1))


def _rms(x: torch.Tensor, mask: Optional[torch.Tensor]) -> float:
    sq = x.double().pow(2).mean(-1)
    return math.sqrt(_mean(sq, mask))


def _frob(x: torch.Tensor, mask: Optional[torch.Tensor]) -> float:
    sq = x.double().pow(2).sum(-1)
    if mask is not None:
        sq = sq * mask.to(sq.dtype)
    return math.sqrt(float(sq.sum()))


def state_diagnostics(e: torch.Tensor, states: Sequence[torch.Tensor],
                      parts: Sequence[Optional[tuple[torch.Tensor, torch.Tensor]]],
                      mask: Optional[torch.Tensor] = None) -> dict:
    """Diagnostics from a trace: ``states`` = [h^0, …, h^R], ``parts[r-1]`` = (S_r, I_r) of the
    injection that produced h^r (None when the injection has no such split). Returns
    ``{"rms_e": float, "per_recurrence": [{r, rel_change, state_share, rms_h, contraction}, …]}``."""
    if len(states) < 2:
        raise ValueError("states: need h^0 and at least one recurrence")
    if len(parts) != len(states) - 1:
        raise ValueError(f"parts: expected {len(states) - 1} entries (one per recurrence), got {len(parts)}")
    rows = [_row(r, states[r], states[r - 1], states[r - 2] if r >= 2 else None, parts[r - 1], mask)
            for r in range(1, len(states))]
    return {"rms_e": _rms(e, mask), "per_recurrence": rows}


def _row(r: int, h: torch.Tensor, prev: torch.Tensor, prev2: Optional[torch.Tensor],
         part: Optional[tuple[torch.Tensor, torch.Tensor]], mask: Optional[torch.Tensor]) -> dict:
    """Recurrence ``r``'s diagnostics from h^r, h^{r-1}, h^{r-2} (None at r = 1) and (S_r, I_r)."""
    diff = h - prev
    rel = _token_norm(diff) / _token_norm(h).clamp_min(1e-30)
    row = {"r": r, "rel_change": _mean(rel, mask), "rms_h": _rms(h, mask)}
    if part is not None:
        s, i = part
        ns, ni = _token_norm(s), _token_norm(i)
        row["state_share"] = _mean(ns / (ns + ni).clamp_min(1e-30), mask)
    else:
        row["state_share"] = 1.0
    if prev2 is not None:
        den = _frob(prev - prev2, mask)
        row["contraction"] = _frob(diff, mask) / den if den > 0 else float("nan")
    else:
        row["contraction"] = float("nan")
    return row


@torch.no_grad()
def trace_export(model, input_ids: torch.Tensor, depth: int) -> dict:
    """Trace a :class:`megaloop.hf.modeling_megaloop.MegaloopForCausalLM` (the evaluation model):
    e [b, s, d], states [h^0 … h^R] and the injection split per recurrence, in evaluation mode
    (the evaluation-time state init)."""
    if not model.config.looped:
        raise ValueError("model: an untied (non-looped) model has no recurrence to trace")
    model.eval()
    p = model.begin(input_ids)
    states, parts = [p.init_state()], []
    for r in range(depth):
        if p.e_qkv is not None:  # DEQ-QKV: e enters Q/K/V, there is no additive split
            parts.append(None)
        else:
            base = p.inject(torch.zeros_like(states[r]))
            parts.append((p.inject(states[r]) - base, base))
        states.append(p.step(states[r], r)[0])
    return {"e": p.e, "states": states, "parts": parts}


def input_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """The real input tokens [n, L] (float 0/1) of rows whose ``loss_mask`` [n, L] marks scored
    targets: every position up to one past the row's last scored target. The last position (no
    target), the token after each EOS under ``data.mask_document_boundaries`` and the last real
    token of a padded row are inputs all the same; only padding after it is not."""
    idx = torch.arange(loss_mask.shape[1], device=loss_mask.device)
    last = torch.where(loss_mask > 0, idx, torch.full_like(idx, -1)).max(dim=1).values
    return (idx[None, :] <= last[:, None] + 1).float()


@torch.no_grad()
def trace_diagnostics(model, input_ids: torch.Tensor, depth: int, mask: Optional[torch.Tensor] = None) -> dict:
    """:func:`state_diagnostics` of :func:`trace_export`'s trace, computed recurrence by recurrence:
    three states and one injection split are held at a time, so memory does not grow with ``depth``
    (the full trace held 3R + 2 tensors [b, s, d])."""
    if not model.config.looped:
        raise ValueError("model: an untied (non-looped) model has no recurrence to trace")
    model.eval()
    p = model.begin(input_ids)
    prev2, prev = None, p.init_state()
    rows = []
    for r in range(depth):
        if p.e_qkv is not None:  # DEQ-QKV: e enters Q/K/V, there is no additive split
            part = None
        else:
            base = p.inject(torch.zeros_like(prev))
            part = (p.inject(prev) - base, base)
        h = p.step(prev, r)[0]
        rows.append(_row(r + 1, h, prev, prev2, part, mask))
        prev2, prev = prev, h
    return {"rms_e": _rms(p.e, mask), "per_recurrence": rows}


def format_table(diag: dict) -> list[list]:
    """Rows for a console table: r, rel change, state share, rms h, contraction."""
    rows = []
    for row in diag["per_recurrence"]:
        rows.append([row["r"], row["rel_change"], row["state_share"], row["rms_h"], row["contraction"]])
    return rows
