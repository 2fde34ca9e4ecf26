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
attention's q, k, v and output (4·d), the MLP's gate, up and product (3·ffn), per token, in the
engine dtype. Attention scores are not counted: PyTorch's SDPA runs a fused kernel on CPU and GPU,
whose memory is linear in L (``tools/bench/bench_eval_memory.py`` measures the estimate against the
peak; README "Evaluation memory").
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

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
    return tokens * (7 * d + 3 * ffn) * _elsize(dtype)


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
    """Raise ConfigError naming ``--batch-size`` / ``--seq-len`` when the largest of ``depths``'
    estimates exceeds ``HEADROOM`` of the device's available memory; return that estimate."""
    batch_size = max(1, int(batch_size))
    est = max((estimate_eval_memory(engine.config, batch_size=batch_size, seq_len=seq_len, prefix_len=prefix_len,
                                    depth=d, prefill_depth=prefill_depth, protocols=protocols, dtype=engine.dtype)
               for d in depths), key=lambda e: e.total_bytes)
    _refuse_unless_fits(
        engine.device, est.total_bytes, batch_size, "--batch-size",
        f"--batch-size {batch_size} × --seq-len {seq_len}: the {est.peak_protocol} pass needs an estimated "
        f"{_size(est.total_bytes)} (logits {_size(est.logits_bytes)}, KV cache {_size(est.kv_bytes)}, "
        f"activations {_size(est.activation_bytes)})",
        "lower --seq-len" + (" or drop a protocol (--no-native / --cache terminal)" if len(est.per_protocol) > 1 else ""))
    return est


def _refuse_unless_fits(device: torch.device, need: int, count: int, count_flag: str, what: str,
                        shrink: str) -> None:
    """Raise ConfigError (``what``, the free memory, and the largest ``count_flag`` value that fits,
    else ``shrink``) when ``need`` bytes for ``count`` sequences exceed ``HEADROOM`` of the free memory."""
    free = available_memory(device)
    budget = HEADROOM * free
    if need <= budget:
        return
    fits = int(budget // (need / count))
    hint = f"{count_flag} {fits} fits" if fits >= 1 else f"even one sequence does not fit: {shrink}"
    raise ConfigError(f"{what} on {device}, more than {HEADROOM:.0%} of the {_size(free)} available; {hint} "
                      f"(--no-memory-check skips this check)")


def estimate_trace_memory(config, *, num_seqs: int, seq_len: int, depth: int,
                          dtype: torch.dtype = torch.float32) -> int:
    """Bytes of ``eval states``' trace (megaloop.eval.states.trace_export), which holds e, the R + 1
    states and the injection's two parts per recurrence [num_seqs, L, d] at once, plus one layer
    visit's activations."""
    tokens = num_seqs * seq_len
    held = (3 * depth + 2) * tokens * int(config.hidden_size) * _elsize(dtype)
    return held + _activation_bytes(config, tokens, dtype)


def check_trace_memory(engine, *, num_seqs: int, seq_len: int, depth: int) -> int:
    """Raise ConfigError naming ``--max-seqs`` / ``--seq-len`` / ``--depth`` when ``eval states``'
    trace exceeds ``HEADROOM`` of the available memory; return the estimate (bytes)."""
    need = estimate_trace_memory(engine.config, num_seqs=num_seqs, seq_len=seq_len, depth=depth, dtype=engine.dtype)
    _refuse_unless_fits(engine.device, need, num_seqs, "--max-seqs",
                        f"--max-seqs {num_seqs} × --seq-len {seq_len} at --depth {depth}: the state trace needs an "
                        f"estimated {_size(need)}", "lower --seq-len or --depth")
    return need


__all__ = ["EvalMemoryEstimate", "HEADROOM", "available_memory", "check_eval_memory", "check_trace_memory",
           "estimate_eval_memory", "estimate_trace_memory"]
