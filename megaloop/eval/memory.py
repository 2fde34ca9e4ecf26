"""Memory check before an evaluation pass: refuse a ``--batch-size`` × ``--seq-len`` that would
not fit, before any forward runs (instead of an out-of-memory kill mid-evaluation).

The estimate is of what one batch adds on top of the loaded model (bytes), per protocol of
:func:`megaloop.eval.ppl.evaluate_ppl`, whose passes run one after another (their logits are freed
between them), so the peak is the largest pass:

* ``native``: logits [b, L, V] in the engine dtype, their FP32 copy (none when the dtype is FP32),
  and the cross-entropy's log-softmax [b, L, V] FP32; plus the activations of one layer visit.
* ``terminal`` / ``per_visit``: the KV cache at the protocol's banks per token
  (:func:`megaloop.inference.kv_cache.kv_bytes_per_token`, at the larger of the prefill and
  scoring depths) for the banks' capacity once the scored n = L − prefix tokens are appended
  (max(L, 2·prefix): a bank doubles when it grows) plus the n tokens' new keys and values, which
  are held until they are committed; the same logits terms over the n tokens; one layer visit's
  activations; and the attention mask [n, L] (boolean, and SDPA's float copy).

One layer visit's activations: the residual stream, the injected input and the state (3·d), the
attention's normed input, q, k, v, output and projection (6·d), the MLP's fused gate-and-up output,
activation and product (4·ffn), per token, in the engine dtype (the two blocks summed). Attention
scores are not counted: PyTorch's SDPA runs a fused kernel on CPU and GPU, whose memory is linear
in L.

Decoding (``generate``, the harness) has its own estimate, :func:`estimate_decode_memory`.
``tools/bench/bench_eval_memory.py`` measures the estimates against the peak (README "Memory check").
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from megaloop.config_utils import ConfigError
from megaloop.inference.kv_cache import kv_bytes_per_token

HEADROOM = 0.9  # fraction of the available memory an evaluation may plan to use
GiB = float(1 << 30)


@dataclass
class EvalMemoryEstimate:
    """Bytes one batch adds to the loaded model, by part (the peak pass's parts) and in total."""

    batch_size: int
    seq_len: int
    peak_protocol: str
    logits_bytes: int
    kv_bytes: int
    activation_bytes: int
    total_bytes: int
    per_protocol: dict  # protocol -> total bytes of its pass


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


def _elsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _logits_bytes(tokens: int, vocab: int, dtype: torch.dtype) -> int:
    el = _elsize(dtype)
    fp32_copy = 0 if dtype == torch.float32 else 4
    return tokens * vocab * (el + fp32_copy + 4)  # model output (+ FP32 copy) + log-softmax


def _activation_bytes(config, tokens: int, dtype: torch.dtype) -> int:
    d, ffn = int(config.hidden_size), int(config.intermediate_size)
    return tokens * (9 * d + 4 * ffn) * _elsize(dtype)


def estimate_eval_memory(config, *, batch_size: int, seq_len: int, prefix_len: int, depth: int,
                         prefill_depth: Optional[int] = None, protocols: Sequence[str] = ("native",),
                         dtype: torch.dtype = torch.float32) -> EvalMemoryEstimate:
    """Estimate (bytes) of one evaluation batch of ``batch_size`` × ``seq_len`` tokens for an HF
    ``MegaloopConfig`` (``vocab_size`` = the padded head rows the logits have)."""
    vocab = int(config.vocab_size)
    tokens = batch_size * seq_len
    act = _activation_bytes(config, tokens, dtype)
    parts: dict[str, tuple[int, int, int]] = {}  # protocol -> (logits, kv, activations)
    if "native" in protocols:
        parts["native"] = (_logits_bytes(tokens, vocab, dtype), 0, act)
    kv_depth = max(depth, prefill_depth or depth)
    n = seq_len - prefix_len  # scored tokens per sequence
    cap = max(seq_len, 2 * prefix_len)  # a bank's capacity after the chunk is appended (it doubles)
    mask = n * seq_len * 5  # the [1, 1, n, L] boolean mask and SDPA's float copy of it
    for mode in ("terminal", "per_visit"):
        if mode in protocols:
            kv = batch_size * (cap + n) * kv_bytes_per_token(config, mode, kv_depth, dtype)
            parts[mode] = (_logits_bytes(batch_size * n, vocab, dtype), kv, act + mask)
    if not parts:
        raise ConfigError(f"--cache: no protocol to estimate in {tuple(protocols)}")
    totals = {k: sum(v) for k, v in parts.items()}
    peak = max(totals, key=totals.get)
    logits, kv, act = parts[peak]
    return EvalMemoryEstimate(batch_size, seq_len, peak, logits, kv, act, totals[peak], totals)


def _cgroup_free() -> Optional[int]:
    """Bytes left under this process's cgroup-v2 memory limit, or None without a limit."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            return max(int(limit) - int(f.read().strip()), 0)
    except (OSError, ValueError):
        return None


def available_memory(device: torch.device) -> int:
    """Free bytes for new tensors on ``device``: CUDA's free memory, else the host's available
    memory (psutil), capped by a cgroup-v2 limit where one applies. ``MEGALOOP_EVAL_MEMORY``
    (bytes) overrides it (tests, shared hosts)."""
    forced = os.environ.get("MEGALOOP_EVAL_MEMORY")
    if forced:
        try:
            return int(float(forced))
        except ValueError:
            raise ConfigError(f"MEGALOOP_EVAL_MEMORY: a number of bytes, got {forced!r}") from None
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    free = int(psutil.virtual_memory().available)
    cg = _cgroup_free()
    return min(free, cg) if cg is not None else free


def check_eval_memory(engine, *, batch_size: int, seq_len: int, prefix_len: int, depths: Sequence[int],
                      prefill_depth: Optional[int] = None, protocols: Sequence[str] = ("native",)) -> EvalMemoryEstimate:
    """Raise ConfigError naming ``--batch-size`` / ``--seq-len`` when the largest of ``depths'``
    estimates exceeds ``HEADROOM`` of the device's available memory; return that estimate."""
    batch_size = max(1, int(batch_size))
    est = max((estimate_eval_memory(engine.config, batch_size=batch_size, seq_len=seq_len, prefix_len=prefix_len,
                                    depth=d, prefill_depth=prefill_depth, protocols=protocols, dtype=engine.dtype)
               for d in depths), key=lambda e: e.total_bytes)
    refuse_unless_fits(
        engine.device, est.total_bytes, batch_size, "--batch-size {n} fits",
        f"--batch-size {batch_size} × --seq-len {seq_len}: the {est.peak_protocol} pass needs an estimated "
        f"{describe(est)}",
        "lower --seq-len" + (" or drop a protocol (--no-native / --cache terminal)" if len(est.per_protocol) > 1 else ""))
    return est


def describe(est: EvalMemoryEstimate) -> str:
    """``'1.20 GiB (logits …, KV cache …, activations …)'``: an estimate's total and parts."""
    return (f"{_size(est.total_bytes)} (logits {_size(est.logits_bytes)}, KV cache {_size(est.kv_bytes)}, "
            f"activations {_size(est.activation_bytes)})")


def refuse_unless_fits(device: torch.device, need: int, count: int, fits: str, what: str, shrink: str,
                       largest: Optional[Callable[[float], int]] = None) -> None:
    """Raise ConfigError (``what``, the free memory, and ``fits`` formatted with the largest count
    ``n`` that fits, else ``shrink``) when ``need`` bytes for ``count`` sequences exceed ``HEADROOM``
    of the free memory. ``largest(budget)``: that count where the need is not proportional to it
    (default: proportional)."""
    free = available_memory(device)
    budget = HEADROOM * free
    if need <= budget:
        return
    n = largest(budget) if largest is not None else int(budget // (need / max(count, 1)))
    hint = fits.format(n=n) if n >= 1 else f"even one sequence does not fit: {shrink}"
    raise ConfigError(f"{what} on {device}, more than {HEADROOM:.0%} of the {_size(free)} available; {hint} "
                      f"(--no-memory-check skips this check)")


def bank_capacity(prompt_len: int, total_len: int) -> int:
    """Tokens a KV bank has room for once it holds ``total_len`` tokens, grown one token at a time
    after a ``prompt_len``-token prefill (``_Bank.append`` in megaloop.hf.cache_megaloop: a full
    bank grows to max(n + 1, 2 × capacity, 16))."""
    cap = max(int(prompt_len), 1)
    while cap < total_len:
        cap = max(cap + 1, 2 * cap, 16)
    return cap


def estimate_decode_memory(config, *, batch_size: int, prompt_len: int, total_len: int, prefill_depth: int,
                           decode_depth: int, mode: str, padded: bool = True,
                           dtype: torch.dtype = torch.float32) -> EvalMemoryEstimate:
    """Estimate (bytes) of prefilling ``batch_size`` prompts of up to ``prompt_len`` tokens and
    decoding them one token per step until a row holds ``total_len`` tokens (``generate``, the
    harness's ``decode`` scoring), through a ``mode`` KV cache. Two phases, the larger is the peak:

    * ``prefill``: the cache of the prompts (b · prompt_len tokens), one layer visit's activations,
      the padded [b, 1, p, p] boolean mask and SDPA's float copy (``padded``: prompts of unequal
      length), the last position's logits;
    * ``decode``: every bank at its grown capacity (:func:`bank_capacity`) for b rows, plus the
      larger of two transients that never coincide: the copy of the other b − 1 rows made when one
      row finishes before the rest (``DecodeState.select`` builds the smaller cache while the old
      one is alive), and one bank's K/V read by attention (a contiguous copy while the bank has
      spare room); a step's logits, mask and activations.

    ``total_len``: the positions a row's cache reaches, padding included
    (:func:`decode_positions`). Per-visit banks are counted at the larger of the two depths for
    every token (an upper bound when they differ). ``seq_len`` of the result is ``total_len``."""
    b, p, T = max(1, int(batch_size)), int(prompt_len), max(int(total_len), int(prompt_len))
    per_tok = kv_bytes_per_token(config, mode, max(prefill_depth, decode_depth), dtype)
    one_bank = 2 * int(config.num_key_value_heads) * int(config.head_dim) * _elsize(dtype)  # K and V of a token
    vocab = int(config.vocab_size)
    step_logits = _logits_bytes(b, vocab, dtype)
    parts = {
        "prefill": (step_logits, b * p * per_tok,
                    _activation_bytes(config, b * p, dtype) + (5 * b * p * p if padded and b > 1 else 0)),
        "decode": (step_logits, b * bank_capacity(p, T) * per_tok + max((b - 1) * T * per_tok, b * T * one_bank),
                   _activation_bytes(config, b, dtype) + 5 * b * T),
    }
    totals = {k: sum(v) for k, v in parts.items()}
    peak = max(totals, key=totals.get)
    logits, kv, act = parts[peak]
    return EvalMemoryEstimate(b, T, peak, logits, kv, act, totals[peak], totals)


def decode_positions(prompt_lens: Sequence[int], max_new_tokens: int, max_context: int) -> int:
    """Positions a row's cache reaches in ``generate``: the longest prompt (shorter ones are
    left-padded to it) plus every generated token but the last, until the row with the shortest
    prompt reaches ``max_context`` real tokens."""
    p, shortest = max(prompt_lens), min(prompt_lens)
    return min(p + max_new_tokens - 1, p - shortest + max(max_context, shortest))


def check_decode_memory(engine, *, batch_size: int, prompt_len: int, total_len: int, prefill_depth: int,
                        decode_depth: int, mode: str, padded: bool = True, what: str, fits: str,
                        shrink: str) -> EvalMemoryEstimate:
    """:func:`estimate_decode_memory` on ``engine``; raise ConfigError (``what`` + the estimate,
    ``fits`` / ``shrink`` as in :func:`refuse_unless_fits`) when it does not fit; return it."""
    est = estimate_decode_memory(engine.config, batch_size=batch_size, prompt_len=prompt_len, total_len=total_len,
                                 prefill_depth=prefill_depth, decode_depth=decode_depth, mode=mode, padded=padded,
                                 dtype=engine.dtype)
    refuse_unless_fits(engine.device, est.total_bytes, est.batch_size, fits,
                       f"{what} ({est.seq_len} tokens held per row, {mode} cache at depth "
                       f"{max(prefill_depth, decode_depth)}): the {est.peak_protocol} phase needs an estimated "
                       f"{describe(est)}", shrink)
    return est


def estimate_trace_memory(config, *, num_seqs: int, seq_len: int, depth: int,
                          dtype: torch.dtype = torch.float32) -> int:
    """Bytes of ``eval states``' trace (megaloop.eval.states.trace_diagnostics), which holds e, three
    states, the injection's two parts and its zero-state output [num_seqs, L, d] and float64 norms
    of one of them (counted as 12 such tensors, whatever the ``depth``), plus one layer visit's
    activations."""
    del depth  # streamed: one recurrence at a time
    tokens = num_seqs * seq_len
    held = 12 * tokens * int(config.hidden_size) * _elsize(dtype)
    return held + _activation_bytes(config, tokens, dtype)


def check_trace_memory(engine, *, num_seqs: int, seq_len: int, depth: int) -> int:
    """Raise ConfigError naming ``--max-seqs`` / ``--seq-len`` / ``--depth`` when ``eval states``'
    trace exceeds ``HEADROOM`` of the available memory; return the estimate (bytes)."""
    need = estimate_trace_memory(engine.config, num_seqs=num_seqs, seq_len=seq_len, depth=depth, dtype=engine.dtype)
    refuse_unless_fits(engine.device, need, num_seqs, "--max-seqs {n} fits",
                        f"--max-seqs {num_seqs} × --seq-len {seq_len} at --depth {depth}: the state trace needs an "
                        f"estimated {_size(need)}", "lower --seq-len or --depth")
    return need


def estimate_copy_memory(config, *, num_seqs: int, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of ``eval copying``'s forward over ``num_seqs`` × ``seq_len`` probe tokens (one depth at a
    time): the native pass (logits, their log-softmax, one layer visit) plus, in FP32, the probe's
    contiguous copy of the shifted logits [b, L − 1, V] (megaloop.eval.copying.copy_scores; under
    BF16 that copy is the FP32 copy the native pass already counts)."""
    est = estimate_eval_memory(config, batch_size=num_seqs, seq_len=seq_len, prefix_len=0, depth=1, dtype=dtype)
    copy = num_seqs * (seq_len - 1) * int(config.vocab_size) * 4 if dtype == torch.float32 else 0
    return est.total_bytes + copy


def check_copy_memory(engine, *, num_seqs: int, half_len: int) -> int:
    """Raise ConfigError naming ``--num-seqs`` / ``--half-len`` when ``eval copying``'s forward
    exceeds ``HEADROOM`` of the available memory; return the estimate (bytes)."""
    need = estimate_copy_memory(engine.config, num_seqs=num_seqs, seq_len=2 * half_len, dtype=engine.dtype)
    refuse_unless_fits(engine.device, need, num_seqs, "--num-seqs {n} fits",
                       f"--num-seqs {num_seqs} × 2 · --half-len {half_len} tokens: the probe's forward needs an "
                       f"estimated {_size(need)}", "lower --half-len")
    return need


# The math SDPA kernel's peak per call, measured on CPU (torch 2.13; T = 1,024-4,096, 4-16 heads):
# 2.28 × the scores [heads, T, T] FP32 (scores, their softmax, a smaller transient) + 4.1 bytes per
# [T, T] entry (the causal mask and its float copy); counted as 2.5 × scores + 5 bytes per entry.
MATH_SCORES_FACTOR, MATH_MASK_BYTES = 2.5, 5


def estimate_fixed_point_memory(config, *, span_len: int, cycle_window: int = 16) -> int:
    """FP32 bytes of ``eval fixed-point`` on one span of ``span_len`` = T tokens (spans run one at a
    time, megaloop.inference.fixed_point.check_span), at its largest moment, the joint solve:
    the math attention of one layer over T tokens (scores of every head, module constants above),
    the states held (e and the solved prefix state, the current, next and anchor states, the
    ``cycle_window`` recent ones: cycle_window + 6 × [T, d]), the KV banks held (both steppers'
    prelude banks, four core sets: the prefix's, the current, previous and anchor recurrences',
    one coda set), and one layer visit's activations. The readouts keep the last position's
    logits only (two rows of V, counted)."""
    t, d = int(span_len), int(config.hidden_size)
    n_pre, n_core, n_coda = int(config.n_prelude), int(config.n_core), int(config.n_coda)
    bank = 2 * int(config.num_key_value_heads) * int(config.head_dim) * 4  # K and V of one layer, per token
    attention = int(MATH_SCORES_FACTOR * int(config.num_attention_heads) * t * t * 4) + MATH_MASK_BYTES * t * t
    states = (cycle_window + 6) * t * d * 4
    banks = (2 * n_pre + 4 * n_core + n_coda) * t * bank
    logits = 2 * int(config.vocab_size) * 4
    return attention + states + banks + logits + _activation_bytes(config, t, torch.float32)


def check_fixed_point_memory(engine, *, prefix_len: int, cycle_window: int = 16) -> int:
    """Raise ConfigError naming ``--prefix-len`` (and the longest prefix that fits) when one span's
    fixed-point solve exceeds ``HEADROOM`` of the available memory; return the estimate (bytes)."""
    def need(prefix: int) -> int:
        return estimate_fixed_point_memory(engine.config, span_len=prefix + 1, cycle_window=cycle_window)

    def longest(budget: float) -> int:  # bisection: the estimate grows with the span, quadratically
        lo, hi = 0, prefix_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid - 1)
        return lo

    total = need(prefix_len)
    refuse_unless_fits(engine.device, total, prefix_len, "--prefix-len {n} fits",
                       f"--prefix-len {prefix_len}: one span's fixed-point solve (FP32, math attention over "
                       f"{prefix_len + 1} tokens) needs an estimated {_size(total)}",
                       "not even with a one-token --prefix-len; free memory or use a larger device",
                       largest=longest)
    return total


__all__ = ["EvalMemoryEstimate", "HEADROOM", "MATH_MASK_BYTES", "MATH_SCORES_FACTOR", "available_memory",
           "bank_capacity", "check_copy_memory", "check_decode_memory", "check_eval_memory",
           "check_fixed_point_memory", "check_trace_memory", "decode_positions", "describe", "estimate_copy_memory",
           "estimate_decode_memory", "estimate_eval_memory", "estimate_fixed_point_memory", "estimate_trace_memory",
           "refuse_unless_fits"]
