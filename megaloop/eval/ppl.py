"""Perplexity under the paper's protocol (SPEC §7) and the sharing penalty.

For every evaluation sequence of ``L`` tokens (8,192 in the paper; the eval set's length here):

1. **prefill** the first half ``x[:L/2]`` at the prefill depth ``P`` — the parallel pass, as in
   training — into a KV cache;
2. **score** the second half ``x[L/2:]`` in *one* parallel pass at depth ``R``: its tokens read the
   prefix through the cached banks, and each other per recurrence as in training. The scored
   predictions are those made at positions ``L/2 .. L-1`` (targets ``x[L/2+1 .. L]``; the
   loader's ``loss_mask`` drops the last position and padding rows).

With a ``terminal`` cache every recurrence reads the prefix's terminal banks; with the full
``per_visit`` cache recurrence ``r`` reads the prefix's depth-``r`` banks, which (at ``P == R``)
is exactly the plain parallel forward over the whole sequence. Hence

    sharing penalty = 100 · (PPL_terminal / PPL_fullKV − 1)   [%]

measures what terminal sharing costs at this depth (Lemma 1: small when the prefix banks have
settled and the current-token update contracts; it is not zero in general). ``native`` PPL is
the plain parallel forward at depth ``R`` over all positions (the training-style metric).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch
import torch.nn.functional as F

from megaloop.config_utils import ConfigError
from megaloop.inference.kv_cache import check_depth, check_mode

PROTOCOLS = ("native", "terminal", "per_visit")


def sharing_penalty(ppl_terminal: float, ppl_full: float) -> float:
    """``100·(PPL_terminal / PPL_fullKV − 1)`` in percent."""
    return 100.0 * (ppl_terminal / ppl_full - 1.0)


# ----------------------------------------------------------------------------- data
@dataclass
class EvalData:
    """Evaluation sequences held in memory: ``tokens``/``labels`` [n, L] int64, ``loss_mask`` [n, L]."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    source: str = ""

    @property
    def num_seqs(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    def batches(self, batch_size: int) -> Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        for i in range(0, self.num_seqs, batch_size):
            yield self.tokens[i:i + batch_size], self.labels[i:i + batch_size], self.loss_mask[i:i + batch_size]


def _manifest_seq_len(path: str) -> Optional[int]:
    import json

    m = Path(path) / "manifest.json"
    if m.is_file():
        try:
            return int(json.loads(m.read_text()).get("seq_len"))
        except (ValueError, TypeError, json.JSONDecodeError):
            return None
    return None


def load_eval_data(data: str, *, seq_len: Optional[int] = None, max_seqs: Optional[int] = None,
                   vocab_size: Optional[int] = None, default_seq_len: Optional[int] = None,
                   cache_dir: Optional[str] = None) -> EvalData:
    """Validation sequences from ``data``: ``default`` (the embedded corpus' validation set, built
    for ``seq_len`` or ``default_seq_len``), ``default:screen``, or an MDS directory (its
    manifest's ``seq_len`` unless ``seq_len`` is given). At most ``max_seqs`` real rows (padding
    rows of the loader are dropped). ``vocab_size`` checks the ids fit the model."""
    from megaloop.data import build_eval_loader

    if max_seqs is not None and max_seqs < 1:
        raise ConfigError(f"--max-seqs: must be >= 1, got {max_seqs}")
    if data == "default" or data.startswith("default:"):
        length = seq_len or default_seq_len
    else:
        if "://" not in data and not Path(data).exists():
            raise ConfigError(f"--data: {data} does not exist (an MDS validation directory or 'default')")
        length = seq_len or _manifest_seq_len(data) or default_seq_len
    if not length or length < 4:
        raise ConfigError(f"--seq-len: need a sequence length >= 4 for {data}, got {length}")
    loader = build_eval_loader(data, seq_len=int(length), micro_batch_size=8, dp_rank=0, dp_size=1,
                               cache_dir=cache_dir)
    toks, labs, masks = [], [], []
    have = 0
    try:
        for batch in loader:
            real = batch["loss_mask"].sum(-1) > 0
            toks.append(batch["tokens"][real])
            labs.append(batch["labels"][real])
            masks.append(batch["loss_mask"][real])
            have += int(real.sum())
            if max_seqs is not None and have >= max_seqs:
                break
    finally:
        loader.close()
    if not have:
        raise ConfigError(f"--data: {data} holds no evaluation sequences")
    out = EvalData(torch.cat(toks)[:max_seqs], torch.cat(labs)[:max_seqs], torch.cat(masks)[:max_seqs], str(data))
    if vocab_size is not None and int(out.tokens.max()) >= vocab_size:
        raise ConfigError(f"--data: {data} holds token id {int(out.tokens.max())} >= the model's vocabulary "
                          f"{vocab_size}: tokenized with a different tokenizer?")
    return out


# ----------------------------------------------------------------------------- scoring
def _nll(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Summed CE and token count of ``logits`` [b, s, V] against ``labels`` [b, s] weighted by ``mask``."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1).to(logits.device),
                         reduction="none")
    m = mask.reshape(-1).to(ce.device)
    return float((ce * m).sum()), float(m.sum())


@dataclass
class PPLResult:
    """PPL of one depth. ``*_ppl`` are None for protocols that were not run."""

    depth: int
    prefill_depth: int
    num_seqs: int
    seq_len: int
    split: int  # prefix length; the second half is scored
    tokens_native: int = 0
    tokens_scored: int = 0  # second-half tokens scored by the cache protocols
    native_ppl: Optional[float] = None  # parallel forward, all positions
    native_ppl_second_half: Optional[float] = None  # parallel forward, the protocol's positions
    terminal_ppl: Optional[float] = None
    per_visit_ppl: Optional[float] = None
    sharing_penalty_pct: Optional[float] = None
    kv_bytes_per_token: dict = field(default_factory=dict)  # mode -> bytes (engine dtype)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _ppl(nll: float, n: float) -> Optional[float]:
    return math.exp(nll / n) if n > 0 else None


def evaluate_ppl(engine, data: EvalData, *, depth: Optional[int] = None, prefill_depth: Optional[int] = None,
                 protocols: Sequence[str] = PROTOCOLS, batch_size: int = 4, split: Optional[int] = None) -> PPLResult:
    """PPL of ``data`` at ``depth`` (default the engine's) under ``protocols``: ``native``
    (plain parallel forward), ``terminal`` and ``per_visit`` (half-prefill protocol, prefix at
    ``prefill_depth``, default ``depth``). The sharing penalty needs both cache protocols."""
    depth = check_depth(depth if depth is not None else engine.depth, "--depth")
    pdepth = check_depth(prefill_depth if prefill_depth is not None else depth, "--prefill-depth")
    for p in protocols:
        if p not in PROTOCOLS:
            raise ConfigError(f"--cache: unknown protocol {p!r}; one of {PROTOCOLS}")
    if batch_size < 1:
        raise ConfigError(f"--batch-size: must be >= 1, got {batch_size}")
    L = data.seq_len
    split = int(split if split is not None else L // 2)
    if not 1 <= split < L:
        raise ConfigError(f"split: prefix length must be in [1, {L}), got {split}")
    engine.check_context(L, "evaluation sequence")
    t0 = time.perf_counter()
    sums = {k: [0.0, 0.0] for k in ("native", "native_half", "terminal", "per_visit")}
    for tokens, labels, mask in data.batches(batch_size):
        if "native" in protocols:
            logits = engine.forward(tokens, depth)
            for key, sl in (("native", slice(None)), ("native_half", slice(split, None))):
                nll, n = _nll(logits[:, sl], labels[:, sl], mask[:, sl])
                sums[key][0] += nll
                sums[key][1] += n
            del logits
        for mode in ("terminal", "per_visit"):
            if mode not in protocols:
                continue
            _, logits = engine.score_with_prefix(tokens[:, :split], tokens[:, split:], depth=depth,
                                                 prefill_depth=pdepth, cache_mode=check_mode(mode))
            nll, n = _nll(logits, labels[:, split:], mask[:, split:])
            sums[mode][0] += nll
            sums[mode][1] += n
            del logits
    res = PPLResult(depth=depth, prefill_depth=pdepth, num_seqs=data.num_seqs, seq_len=L, split=split,
                    tokens_native=int(sums["native"][1]),
                    tokens_scored=int(max(sums["terminal"][1], sums["per_visit"][1], sums["native_half"][1])),
                    native_ppl=_ppl(*sums["native"]), native_ppl_second_half=_ppl(*sums["native_half"]),
                    terminal_ppl=_ppl(*sums["terminal"]), per_visit_ppl=_ppl(*sums["per_visit"]),
                    kv_bytes_per_token={m: engine.kv_bytes_per_token(m, depth) for m in ("terminal", "per_visit")})
    if res.terminal_ppl is not None and res.per_visit_ppl is not None:
        res.sharing_penalty_pct = sharing_penalty(res.terminal_ppl, res.per_visit_ppl)
    res.seconds = time.perf_counter() - t0
    return res


def protocols_for(cache: str, native: bool = True) -> tuple[str, ...]:
    """CLI ``--cache terminal|per_visit|both`` (+ native) → protocol names."""
    if cache not in ("terminal", "per_visit", "both"):
        raise ConfigError(f"--cache: one of terminal, per_visit, both; got {cache!r}")
    modes = ("terminal", "per_visit") if cache == "both" else (cache,)
    return (("native",) if native else ()) + modes


__all__ = ["EvalData", "PPLResult", "PROTOCOLS", "evaluate_ppl", "load_eval_data", "protocols_for",
           "sharing_penalty"]
