"""Adaptive per-token depth for one-token decode steps (``trust_remote_code``: torch + stdlib only).

A decode step feeds one new token per row. Every row runs the core recurrence until its exit
criterion holds (at or after ``min_depth``) or ``max_depth`` is reached; the row's state and its
core KV then freeze at that recurrence, the coda and head read the frozen state.

Criteria (all compare recurrence ``r`` with ``r − 1``, so the earliest exit is recurrence 2):

* ``latent:ε`` — relative state change ``‖hʳ − hʳ⁻¹‖ / ‖hʳ‖ < ε`` (per row, FP32). Free: no
  readout.
* ``kl:ε`` — ``KL(pʳ ‖ pʳ⁻¹) < ε`` (nats) between successive readouts ``p = softmax(head(norm(
  coda(h))))`` over the real vocabulary. Costs one coda + head pass per recurrence from
  ``min_depth − 1`` on (the coda reads the cache; the readout's KV is discarded).
* ``argmax:k`` — the readout's top-1 token has been the same for ``k`` successive recurrences
  (k ≥ 2). Same readout cost as ``kl``.

Caches: *terminal* — a row keeps the KV of its exit recurrence, one bank per physical layer,
exactly as at fixed depth. *per_visit* — a row that stopped at depth ``d`` has no visits
``d..`` of its own; its missing deeper banks are defined as its last bank (visit ``d − 1``), the
same rule the cache applies when later tokens run deeper than cached ones.

Finished rows: ``compaction=False`` (masking) keeps computing every row at full batch until the
last row exits and discards the finished rows' results; ``compaction=True`` runs the core only
on the rows still active (their inputs and cached core banks gathered when the set shrinks).
While every row is active both are the fixed-depth forward op for op, so ``ε = 0`` (never exit)
gives the fixed-depth logits at ``max_depth`` bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

CRITERIA = ("latent", "kl", "argmax")


@dataclass(frozen=True)
class ExitPolicy:
    """When a token stops recurring. ``threshold``: ε for latent / kl, the run length k for argmax."""

    criterion: str
    threshold: float
    min_depth: int = 2
    max_depth: int = 8
    compaction: bool = False

    def __post_init__(self) -> None:
        if self.criterion not in CRITERIA:
            raise ValueError(f"exit_criterion: unknown criterion {self.criterion!r}; one of {CRITERIA}")
        t = self.threshold
        if self.criterion == "argmax":
            if t != int(t) or t < 2:
                raise ValueError(f"exit_criterion: argmax needs an integer run length k >= 2, got {t:g}")
        elif math.isnan(t) or t < 0:
            raise ValueError(f"exit_criterion: threshold must be >= 0, got {t}")
        if int(self.min_depth) != self.min_depth or self.min_depth < 2:
            raise ValueError(f"min_depth: must be an integer >= 2 (criteria compare successive recurrences), "
                             f"got {self.min_depth}")
        if int(self.max_depth) != self.max_depth or self.max_depth < self.min_depth:
            raise ValueError(f"max_depth: must be an integer >= min_depth ({self.min_depth}), got {self.max_depth}")

    @classmethod
    def parse(cls, spec: str, *, min_depth: Optional[int] = None, max_depth: int = 8,
              compaction: bool = False) -> "ExitPolicy":
        """``"latent:1e-3"``, ``"kl:5e-4"``, ``"argmax:3"`` → policy."""
        name, sep, value = str(spec).partition(":")
        if not sep:
            raise ValueError(f"exit_criterion: expected NAME:VALUE (e.g. latent:1e-3), got {spec!r}")
        try:
            threshold = float(value)
        except ValueError:
            raise ValueError(f"exit_criterion: {value!r} is not a number in {spec!r}") from None
        return cls(name.strip(), threshold, 2 if min_depth is None else int(min_depth), int(max_depth), compaction)

    @classmethod
    def of_config(cls, config, exit_criterion=None, min_depth=None, max_depth=None) -> Optional["ExitPolicy"]:
        """The policy of these arguments, each falling back on the model config's (``max_depth``: then
        ``decode_depth``); None = fixed depth. An explicit 0 is kept (``__post_init__`` refuses it)."""
        pick = lambda *vals: next((v for v in vals if v is not None), None)  # noqa: E731
        spec = pick(exit_criterion, config.exit_criterion)
        return cls.parse(spec, min_depth=pick(min_depth, config.min_depth),
                         max_depth=pick(max_depth, config.max_depth, config.decode_depth)) if spec else None

    @property
    def spec(self) -> str:
        return f"{self.criterion}:{self.threshold:g}"

    @property
    def needs_readout(self) -> bool:
        return self.criterion != "latent"


@torch.no_grad()
def adaptive_decode(model, input_ids: torch.Tensor, cache, policy: ExitPolicy,
                    attention_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None):
    """One adaptive decode step of a ``MegaloopForCausalLM`` over a filled ``MegaloopCache``.

    Args: ``input_ids`` [b, 1]; ``attention_mask`` [b, cached + 1] (0 = padding) or None;
    ``position_ids`` [b, 1] (default: counted over the unpadded tokens of ``attention_mask``, else
    the cache length; ``MegaloopModel.frame``). The cache gets the new token's banks.
    Returns ``(logits [b, 1, vocab_size] (model dtype), depths [b] (long), row_recurrences)``:
    ``row_recurrences`` counts the (row, recurrence) core evaluations actually computed.
    """
    cfg = model.config
    if not cfg.looped:
        raise ValueError("exit_criterion: adaptive depth needs a looped model (arch='looped')")
    b, s = input_ids.shape
    past = cache.get_seq_length()
    if s != 1 or past == 0:
        raise ValueError(f"adaptive decoding feeds one token per row after a prefill; got {s} tokens "
                         f"over {past} cached")
    full = model.begin(input_ids, positions=position_ids, attention_mask=attention_mask, past=cache)
    dev = input_ids.device
    per_visit = cache.mode == "per_visit"
    new: dict = {("prelude", i, 0): kv for i, kv in enumerate(full.prelude_kv)}
    h = full.init_state()
    vocab = cfg.tokenizer_vocab_size
    depths = torch.zeros(b, dtype=torch.long, device=dev)
    active = torch.ones(b, dtype=torch.bool, device=dev)
    idx = None  # rows computed this recurrence (None: all b rows)
    p = full  # the pass over the rows computed
    core_kv: list = []  # full-batch KV of each core layer (finished rows frozen)
    prev_lp = prev_top = streak = None
    computed, run = 0, 0
    for r in range(policy.max_depth):
        run = r + 1
        hs = h if idx is None else h.index_select(0, idx)
        all_active = idx is None and bool(active.all())
        h_new, kvs = p.step(hs, r)
        for i, kv in enumerate(kvs):
            if len(core_kv) <= i:
                core_kv.append(kv)
            elif all_active:
                core_kv[i] = kv
            elif idx is not None:
                core_kv[i] = tuple(whole.index_copy(0, idx, part) for whole, part in zip(core_kv[i], kv))
            else:
                keep = active[:, None, None, None]
                core_kv[i] = tuple(torch.where(keep, part, whole) for whole, part in zip(core_kv[i], kv))
            if per_visit:
                new[("core", i, r)] = core_kv[i]
        computed += hs.shape[0]
        rows_active = active if idx is None else active.index_select(0, idx)  # [n] (all True if compacted)
        if run >= policy.min_depth - 1 and policy.needs_readout:
            logits, _ = p.readout(h_new, keep=1)  # FP32 log-probs over the real vocabulary, [n, V]
            lp = torch.log_softmax(logits[:, -1, :vocab].float(), -1)
            top = lp.argmax(-1)
            if policy.criterion == "kl" and prev_lp is not None:
                stat = (lp.exp() * (lp - prev_lp)).sum(-1).clamp_min(0.0)  # rounding can dip below 0
            streak = torch.ones_like(top) if prev_top is None else torch.where(top == prev_top, streak + 1, 1)
            prev_lp, prev_top = lp, top
        if policy.criterion == "latent":
            diff = (h_new - hs).float().flatten(1).norm(dim=1)
            stat = diff / h_new.float().flatten(1).norm(dim=1).clamp_min(1e-30)
        if run >= policy.max_depth:
            stop = rows_active
        elif run >= policy.min_depth:
            hit = streak >= int(policy.threshold) if policy.criterion == "argmax" else stat < policy.threshold
            stop = rows_active & hit
        else:
            stop = torch.zeros_like(rows_active)
        if idx is None:
            h = h_new if all_active else torch.where(active[:, None, None], h_new, h)
            stopped = stop
        else:
            h = h.index_copy(0, idx, h_new)
            stopped = torch.zeros_like(active).index_copy(0, idx, stop)
        depths = torch.where(stopped, run, depths)
        active = active & ~stopped
        if not bool(active.any()):
            break
        if policy.compaction and bool(stop.any()):
            left = ~stop  # subset rows that continue
            idx = active.nonzero().squeeze(1)
            p = full.rows(idx)
            if prev_lp is not None:
                prev_lp, prev_top, streak = prev_lp[left], prev_top[left], streak[left]
    if not per_visit:
        new.update({("core", i, run - 1): kv for i, kv in enumerate(core_kv)})
    logits, kvs = full.readout(h)
    new.update({("coda", i, 0): kv for i, kv in enumerate(kvs)})
    cache.commit(new, run, 1)
    return logits, depths, computed


__all__ = ["CRITERIA", "ExitPolicy", "adaptive_decode"]
