"""Perplexity under the paper's protocol (SPEC §7) and the sharing penalty.

For every evaluation sequence of ``L`` tokens (the paper: ``L = 8,192`` with a 4,096-token prefix,
:data:`PAPER_SEQ_LEN` / :data:`PAPER_PREFIX_LEN`; here ``--seq-len`` / ``--prefix-len``, default the
eval set's length and half of it):

1. **prefill** the first half ``x[:L/2]`` (``prefix_len`` tokens) at the prefill depth ``P`` — the
   parallel pass, as in training — into a KV cache;
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

Sequences longer than the model's training ``seq_len`` (``config.max_position_embeddings``) use
RoPE positions the model never saw (no rescaling is applied): PPL then mixes length
extrapolation with what is being measured, so compare such numbers only across models with the
same training length. ``PPLResult.rope_extrapolated`` records it.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from megaloop.config_utils import ConfigError
from megaloop.data.errors import DataError, NothingPackedError
from megaloop.eval.text_data import (JSONL_SUFFIXES, PARQUET_SUFFIXES, PLAIN_SUFFIXES, EvalData, load_text_data,
                                     shifted_targets, text_format)
from megaloop.inference.kv_cache import check_depth, check_mode, held_depth

PROTOCOLS = ("native", "terminal", "per_visit")
PAPER_SEQ_LEN = 8192  # the paper's PPL sequences ...
PAPER_PREFIX_LEN = PAPER_SEQ_LEN // 2  # ... with the first half prefilled


def sharing_penalty(ppl_terminal: float, ppl_full: float) -> float:
    """``100·(PPL_terminal / PPL_fullKV − 1)`` in percent."""
    return 100.0 * (ppl_terminal / ppl_full - 1.0)


# ----------------------------------------------------------------------------- data
def _manifest(path: str) -> dict:
    import json

    m = Path(path) / "manifest.json"
    if m.is_file():
        try:
            return json.loads(m.read_text())
        except (OSError, json.JSONDecodeError):
            return {}
    return {}


def _check_tokenizer(data: str, manifest: dict, sha256: Union[str, Sequence[str], None], hint: Optional[str] = None,
                     given: Optional[str] = None) -> None:
    """ConfigError when the set's manifest records a tokenizer other than ``sha256``'s (one digest, or
    several that all name the checkpoint's tokenizer: ``Tokenizer.sha256s``); ``hint``
    (e.g. the run's own validation set) is offered first; ``given``: the ``--tokenizer`` file in use
    (it replaced the checkpoint's), named in place of "the checkpoint's tokenizer"."""
    from megaloop.data.tokenizer import manifest_tokenizer_sha256

    have = manifest_tokenizer_sha256(manifest)
    accepted = (sha256,) if isinstance(sha256, str) else tuple(sha256 or ())
    sha256 = accepted[0] if accepted else None
    if sha256 and have and have not in accepted:
        fixes = (f"{hint}; or " if hint else "") + "rebuild the set, or pass the matching --tokenizer"
        using = f"--tokenizer {given} is" if given else "the checkpoint's tokenizer is"
        raise ConfigError(f"--data: {data} was tokenised with tokenizer sha256 {have[:12]}…, {using} "
                          f"{sha256[:12]}… ({fixes})")


def _read_rows(data: str, length: int, max_seqs: Optional[int], cache_dir: Optional[str],
               tokenizer_sha256: Union[str, Sequence[str], None] = None, tokenizer_hint: Optional[str] = None,
               tokenizer_given: Optional[str] = None):
    """(tokens [n, length], labels, mask, sources or None, eos id) of the real rows of an MDS set.

    With ``max_seqs`` on a set with a ``source`` column, the rows are the first ``max_seqs`` of the
    MixVal order (sources interleaved round-robin, as in-training validation), kept in file order:
    a source-balanced subset instead of the first source's rows."""
    from megaloop.data import build_eval_loader

    loader = build_eval_loader(data, seq_len=int(length), micro_batch_size=8, dp_rank=0, dp_size=1,
                               cache_dir=cache_dir, with_source=True)
    try:
        _check_tokenizer(data, loader.manifest, tokenizer_sha256, tokenizer_hint, tokenizer_given)
    except ConfigError:
        loader.close()
        raise
    has_source = "source" in (loader.manifest.get("columns") or {})
    toks, labs, masks, srcs = [], [], [], []
    have = 0
    try:
        for batch in loader:
            real = batch["loss_mask"].sum(-1) > 0
            toks.append(batch["tokens"][real])
            labs.append(batch["labels"][real])
            masks.append(batch["loss_mask"][real])
            srcs.extend(s for s, ok in zip(batch["source"], real.tolist()) if ok)
            have += int(real.sum())
            if max_seqs is not None and have >= max_seqs and not has_source:  # balanced: read all once
                break
    finally:
        loader.close()
    if max_seqs is not None and has_source and len(set(srcs)) > 1:
        keep = balanced_rows(srcs, max_seqs)
        sel = torch.tensor(keep, dtype=torch.long)
        return (torch.cat(toks)[sel], torch.cat(labs)[sel], torch.cat(masks)[sel], [srcs[i] for i in keep],
                int(loader.manifest["eos_id"]))
    if not have:
        raise ConfigError(f"--data: {data} holds no evaluation sequences")
    return (torch.cat(toks), torch.cat(labs), torch.cat(masks), (srcs if has_source else None),
            int(loader.manifest["eos_id"]))


def balanced_rows(sources: Sequence[str], max_seqs: int) -> list[int]:
    """Indices of the first ``max_seqs`` rows of the MixVal order (sources interleaved round-robin,
    :func:`megaloop.data.loaders.source_balanced_order`), in file order."""
    from megaloop.data.loaders import source_balanced_order

    return sorted(source_balanced_order(list(sources))[:max_seqs])


def repack(tokens: torch.Tensor, sources: Optional[list[str]],
           seq_len: int) -> tuple[torch.Tensor, Optional[list[str]]]:
    """Rows [n, L0] re-cut into ``seq_len``-token rows: the rows of each source (all rows when
    ``sources`` is None) are concatenated in order and cut; tails shorter than ``seq_len`` drop."""
    groups: dict[Optional[str], list[int]] = {}
    for i in range(tokens.shape[0]):
        groups.setdefault(sources[i] if sources is not None else None, []).append(i)
    out, out_src = [], []
    for src, rows in groups.items():
        stream = tokens[rows].reshape(-1)
        n = stream.numel() // seq_len
        out.append(stream[:n * seq_len].reshape(n, seq_len))
        out_src.extend([src] * n)
    packed = torch.cat(out) if out else torch.zeros(0, seq_len, dtype=torch.long)
    return packed, (out_src if sources is not None else None)


def check_data_arg(data: str) -> None:
    """ConfigError naming ``--data`` when it cannot be an evaluation set: a path that does not
    exist, or a file that is neither a known text format nor a directory (an MDS set is a
    directory). Cheap: callers run it before loading a model."""
    if data == "default" or data.startswith("default:") or "://" in data:
        return
    path = Path(data)
    if not path.exists():
        raise ConfigError(f"--data: {data} does not exist (an MDS validation directory, a text file or 'default')")
    if path.is_file() and text_format(data) is None:
        known = ", ".join(PLAIN_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES)
        raise ConfigError(f"--data: {data} is a file of no known text format (suffixes {known}); an MDS "
                          f"evaluation set is the directory that holds index.json")


def load_eval_data(data: str, *, seq_len: Optional[int] = None, max_seqs: Optional[int] = None,
                   vocab_size: Optional[int] = None, default_seq_len: Optional[int] = None,
                   cache_dir: Optional[str] = None, encode=None, eos_id: Optional[int] = None,
                   text_field: str = "text", tokenizer_sha256: Union[str, Sequence[str], None] = None,
                   tokenizer_hint: Optional[str] = None, tokenizer_given: Optional[str] = None) -> EvalData:
    """Validation sequences from ``data``:

    * ``default`` (the embedded corpus' validation set, built for ``seq_len`` or
      ``default_seq_len``) or ``default:screen``;
    * an MDS directory: at its manifest's ``seq_len``; a different ``seq_len`` re-cuts its rows
      (consecutive rows of one ``source`` concatenated, see :func:`repack`);
    * a text file (``.txt``/``.raw``, ``.jsonl[.gz]``, ``.parquet``; :mod:`megaloop.eval.text_data`),
      tokenised with ``encode`` (the checkpoint's tokenizer) at ``seq_len`` or ``default_seq_len``.

    At most ``max_seqs`` real rows (padding rows of the loader are dropped). ``vocab_size``
    checks the ids fit the model; ``tokenizer_sha256`` (the checkpoint's tokenizer file) must
    match the tokenizer an MDS set's manifest records (``tokenizer_hint``: a remedy the refusal
    offers first; ``tokenizer_given``: the ``--tokenizer`` file that replaced the checkpoint's, named
    instead of it). ``sources`` holds the set's ``source`` column when it has one."""
    if max_seqs is not None and max_seqs < 1:
        raise ConfigError(f"--max-seqs: must be >= 1, got {max_seqs}")
    if seq_len is not None and seq_len < 4:
        raise ConfigError(f"--seq-len: need a sequence length >= 4, got {seq_len}")
    check_data_arg(data)
    is_default = data == "default" or data.startswith("default:")
    if not is_default and text_format(data) is not None and Path(data).is_file():
        if encode is None:
            raise ConfigError(f"--data: {data} is a text file: the checkpoint needs a tokenizer (--tokenizer)")
        length = seq_len or default_seq_len
        if not length or length < 4:
            raise ConfigError(f"--seq-len: need a sequence length >= 4 for {data}, got {length}")
        out = load_text_data(data, encode=encode, eos_id=eos_id, seq_len=int(length), max_seqs=max_seqs,
                             text_field=text_field)
    else:
        stored = None if is_default else _manifest(data).get("seq_len")
        length = (seq_len or default_seq_len) if is_default else (stored or seq_len or default_seq_len)
        if not length or length < 4:
            raise ConfigError(f"--seq-len: need a sequence length >= 4 for {data}, got {length}")
        want = seq_len if (seq_len and stored and seq_len != stored) else None
        try:
            tokens, labels, mask, sources, eos = _read_rows(data, int(length), None if want else max_seqs,
                                                            cache_dir, tokenizer_sha256, tokenizer_hint,
                                                            tokenizer_given)
        except DataError as err:
            if is_default and isinstance(err, NothingPackedError):  # the embedded corpus is too small for it
                raise ConfigError(f"--seq-len {length}: the embedded corpus ('--data {data}') cannot fill one "
                                  f"sequence of {length} tokens ({err.counts}); use a shorter --seq-len or your "
                                  f"own --data") from None
            if str(err).startswith("--"):
                raise
            raise DataError(f"--data: {err}") from None
        if want:
            tokens, sources = repack(tokens, sources, int(want))
            if tokens.shape[0] == 0:
                raise ConfigError(f"--seq-len: {data} holds {stored}-token rows too few to re-cut into one "
                                  f"{want}-token sequence per source")
            if max_seqs is not None and sources is not None and len(set(sources)) > 1:
                keep = balanced_rows(sources, max_seqs)  # the same source-balanced subset as at the set's length
                tokens, sources = tokens[torch.tensor(keep, dtype=torch.long)], [sources[i] for i in keep]
            else:
                tokens, sources = tokens[:max_seqs], (sources[:max_seqs] if sources is not None else None)
            labels, mask = shifted_targets(tokens, eos)
        else:
            tokens, labels, mask = tokens[:max_seqs], labels[:max_seqs], mask[:max_seqs]
            sources = sources[:max_seqs] if sources is not None else None
        out = EvalData(tokens, labels, mask, str(data), sources)
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
    split: int  # prefix length (= prefix_len); the rest is scored
    prefix_len: int = 0  # tokens prefilled per sequence
    training_seq_len: int = 0  # the model's training sequence length (RoPE positions seen in training)
    rope_extrapolated: bool = False  # seq_len > training_seq_len: later positions are extrapolated
    tokens_native: int = 0
    tokens_scored: int = 0  # second-half tokens scored by the cache protocols
    native_ppl: Optional[float] = None  # parallel forward, all positions
    native_ppl_second_half: Optional[float] = None  # parallel forward, the protocol's positions
    terminal_ppl: Optional[float] = None
    per_visit_ppl: Optional[float] = None
    sharing_penalty_pct: Optional[float] = None
    kv_bytes_per_token: dict = field(default_factory=dict)  # mode -> bytes (engine dtype)
    source_counts: Optional[dict] = None  # scored sequences per `source` (sets with a source column)
    seconds: float = 0.0
    # adaptive decode (engine.exit): cache protocol -> DepthLog.to_dict() over its scored tokens only
    adaptive_depths: Optional[dict] = None

    def to_dict(self) -> dict:
        return asdict(self)


def source_counts(sources: Sequence[str]) -> dict[str, int]:
    """``{source: rows}`` of the scored rows, sorted by source name."""
    from collections import Counter

    return dict(sorted(Counter(map(str, sources)).items()))


def _ppl(nll: float, n: float) -> Optional[float]:
    return math.exp(nll / n) if n > 0 else None


def check_prefix_len(prefix_len: int, seq_len: int) -> None:
    """ConfigError naming ``--prefix-len`` unless it leaves a scored target: the last position of a
    ``seq_len``-token sequence has no target, so the prefix is ``1 .. seq_len - 2`` tokens."""
    if not 1 <= prefix_len <= seq_len - 2:
        raise ConfigError(f"--prefix-len: must be in [1, {seq_len - 2}] for {seq_len}-token sequences (the last "
                          f"position has no target, so a longer prefix leaves no token to score), got {prefix_len}")


def evaluate_ppl(engine, data: EvalData, *, depth: Optional[int] = None, prefill_depth: Optional[int] = None,
                 protocols: Sequence[str] = PROTOCOLS, batch_size: int = 4, split: Optional[int] = None,
                 prefix_len: Optional[int] = None, stepwise: bool = False) -> PPLResult:
    """PPL of ``data`` at ``depth`` (default the engine's) under ``protocols``: ``native``
    (plain parallel forward), ``terminal`` and ``per_visit`` (prefill the first ``prefix_len``
    tokens — default half the sequence; ``split`` is the old name — at ``prefill_depth``, default
    ``depth``, and score the rest). The sharing penalty needs both cache protocols. Sequences
    longer than the engine's ``max_context`` are refused (raise it to extrapolate RoPE). The cache
    protocols score the rest in one parallel pass, or token by token under the engine's exit policy
    or with ``stepwise`` (fixed ``depth``; :meth:`InferenceEngine.score_with_prefix`)."""
    depth = check_depth(depth if depth is not None else engine.depth, "--depth")
    pdepth = check_depth(prefill_depth if prefill_depth is not None else depth, "--prefill-depth")
    for p in protocols:
        if p not in PROTOCOLS:
            raise ConfigError(f"--cache: unknown protocol {p!r}; one of {PROTOCOLS}")
    if batch_size < 1:
        raise ConfigError(f"--batch-size: must be >= 1, got {batch_size}")
    L = data.seq_len
    given = prefix_len if prefix_len is not None else split
    split = int(given if given is not None else L // 2)
    check_prefix_len(split, L)
    engine.check_context(L, "evaluation sequence")
    t0 = time.perf_counter()
    sums = {k: [0.0, 0.0] for k in ("native", "native_half", "terminal", "per_visit")}
    policy = getattr(engine, "exit", None)
    logs = {}
    if policy is not None:
        from megaloop.inference.adaptive import DepthLog

        logs = {m: DepthLog() for m in ("terminal", "per_visit") if m in protocols}
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
            kw = {"stepwise": True} if stepwise else {}
            if policy is not None:  # this protocol's depths, over its scored tokens only
                kw["scored"] = mask[:, split:] > 0
                outer, engine.depth_log = engine.depth_log, logs[mode]
            try:
                _, logits = engine.score_with_prefix(tokens[:, :split], tokens[:, split:], depth=depth,
                                                     prefill_depth=pdepth, cache_mode=check_mode(mode), **kw)
            finally:
                if policy is not None:
                    engine.depth_log = outer
            nll, n = _nll(logits, labels[:, split:], mask[:, split:])
            sums[mode][0] += nll
            sums[mode][1] += n
            del logits
    trained = int(engine.config.max_position_embeddings)
    res = PPLResult(depth=depth, prefill_depth=pdepth, num_seqs=data.num_seqs, seq_len=L, split=split,
                    prefix_len=split, training_seq_len=trained, rope_extrapolated=L > trained,
                    tokens_native=int(sums["native"][1]),
                    tokens_scored=int(max(sums["terminal"][1], sums["per_visit"][1], sums["native_half"][1])),
                    native_ppl=_ppl(*sums["native"]), native_ppl_second_half=_ppl(*sums["native_half"]),
                    terminal_ppl=_ppl(*sums["terminal"]), per_visit_ppl=_ppl(*sums["per_visit"]),
                    kv_bytes_per_token={m: engine.kv_bytes_per_token(m, held_depth(pdepth, depth, policy))
                                        for m in ("terminal", "per_visit")})
    if logs:
        res.adaptive_depths = {m: {"criterion": policy.spec, "min_depth": policy.min_depth,
                                   "max_depth": policy.max_depth, **log.to_dict()} for m, log in logs.items()}
        for log in logs.values():  # the engine's own log keeps every step, as before
            engine.depth_log.counts.update(log.counts)
            engine.depth_log.row_recurrences += log.row_recurrences
    if data.sources is not None:
        res.source_counts = source_counts(data.sources)
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


__all__ = ["EvalData", "PAPER_PREFIX_LEN", "PAPER_SEQ_LEN", "PPLResult", "PROTOCOLS", "balanced_rows",
           "check_data_arg", "check_prefix_len", "evaluate_ppl", "load_eval_data", "protocols_for", "repack",
           "sharing_penalty", "source_counts"]
