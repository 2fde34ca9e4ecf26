"""Fixed-point checks of looped models (SPEC §8; paper Lemma 1 and its appendix experiment).

**Solver** (:func:`solve`): iterate a recurrence ``h ← F(h)`` in FP32 with PyTorch's reference
(math) attention kernel, at most ``max_steps = 1024`` recurrences. A solve *qualifies* when

1. the max per-token relative state change ``max_t ‖h_t^{n} − h_t^{n−1}‖ / ‖h_t^{n−1}‖`` and the
   per-layer K/V change (the same measure on every core layer's keys and values, per token) stay
   ≤ ``tol = 1e-5`` for ``hold_steps = 8`` consecutive recurrences; then
2. ``confirm_steps = 16`` confirmation recurrences keep the state and K/V within
   ``drift_tol = 5e-5`` (relative, per token) of the state where the hold completed; then
3. one final recurrence again changes state and K/V by ≤ ``tol``.

A failed confirmation or final check restarts the search. Small steps alone do not qualify a
slow drift or a slowly travelling cycle (step 2), and oscillations never reach step 1; rejected
solves report why (``cycle of period p`` when the state returns to one of its last 16 values,
``drift during confirmation``, ``not converged``, ``non-finite state``). The solve depth is the
number of recurrences run until qualification.

**Joint vs frozen-prefix** (:func:`check_span`): for a span ``x_1..x_T`` (prefix ``x_<T``, current
token ``x_T``), three solves start from the model's evaluation-time state init:

* *prefix-only*: the prefix tokens iterated together (training-style parallel recurrence);
* *joint*: all ``T`` tokens iterated together;
* *frozen-prefix current token*: the prefix's solved KV banks are frozen — prelude KV, each core
  layer's KV from the final recurrence, coda KV of the solved states — and only the current
  token is iterated, reading the frozen banks and recomputing its own K/V every recurrence
  (exactly terminal KV sharing with a converged prefix).

Lemma 1 predicts that joint iteration and frozen-prefix decoding reach the same fixed point;
reported are the relative state gap ``‖h_T^joint − h_T^frozen‖ / ‖h_T^joint‖``, the prediction
``KL(p_joint ‖ p_frozen)`` of the next token, the prefix gap (joint vs prefix-only), the gap from
a zero current-token init, and a *control*: freezing a depth-``control_depth`` prefix (R=5) instead
of the converged one (the paper finds gaps 5–6 orders of magnitude larger). A span counts as
qualified when its three solves qualify; the control needs its own current-token solve to qualify.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import torch

from megaloop.config_utils import ConfigError

KV = tuple[torch.Tensor, torch.Tensor]
StepFn = Callable[[torch.Tensor], tuple[torch.Tensor, list]]


# ----------------------------------------------------------------------------- criteria
@dataclass
class Criteria:
    """Qualification thresholds (paper defaults)."""

    tol: float = 1e-5
    hold_steps: int = 8
    confirm_steps: int = 16
    drift_tol: float = 5e-5
    max_steps: int = 1024
    cycle_window: int = 16  # states kept to name cycles among rejected solves

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ConfigError(f"--max-steps: must be >= 1, got {self.max_steps}")
        if self.max_steps > 1024:
            raise ConfigError(f"--max-steps: at most 1024 recurrences (SPEC §8), got {self.max_steps}")
        if not (self.tol > 0 and self.drift_tol > 0 and self.hold_steps >= 1 and self.confirm_steps >= 0):
            raise ConfigError("fixed-point criteria: tolerances must be > 0 and step counts >= 1")


def rel_change(new: torch.Tensor, old: torch.Tensor, eps: float = 1e-30) -> float:
    """``max_t ‖new_t − old_t‖ / ‖old_t‖`` over tokens (norms over the last dim, FP64 reduce)."""
    diff = (new.double() - old.double()).norm(dim=-1)
    ref = old.double().norm(dim=-1).clamp_min(eps)
    return float((diff / ref).max()) if diff.numel() else 0.0


def _kv_rows(t: torch.Tensor) -> torch.Tensor:
    """[b, heads, s, hd] → [b, s, heads·hd] (one row per token)."""
    b, h, s, hd = t.shape
    return t.transpose(1, 2).reshape(b, s, h * hd)


def kv_change(new: Sequence[KV], old: Sequence[KV]) -> float:
    """Max over layers, K and V, and tokens of the per-token relative change."""
    out = 0.0
    for (k1, v1), (k0, v0) in zip(new, old):
        out = max(out, rel_change(_kv_rows(k1), _kv_rows(k0)), rel_change(_kv_rows(v1), _kv_rows(v0)))
    return out


@dataclass
class Solve:
    """Outcome of one solve."""

    qualified: bool
    steps: int  # recurrences run (at qualification, or when stopped)
    reason: str  # "qualified" or why not
    last_change: float  # state change of the last recurrence
    last_kv_change: float
    hold_at: Optional[int] = None  # recurrence at which an 8-step hold first completed
    restarts: int = 0  # failed confirmations / final checks
    state: Optional[torch.Tensor] = field(default=None, repr=False)
    kv: Optional[list] = field(default=None, repr=False)  # K/V of the last recurrence (per core layer)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("state")
        d.pop("kv")
        return d


def solve(step: StepFn, h0: torch.Tensor, criteria: Optional[Criteria] = None) -> Solve:
    """Iterate ``h, kv = step(h)`` from ``h0`` until the state qualifies as a fixed point (see
    module docstring) or ``criteria.max_steps`` recurrences. ``step`` returns the next state and
    the list of K/V pairs its core layers produced (may be empty for plain maps)."""
    c = criteria or Criteria()
    h, prev_kv = h0, None
    phase, hold, confirm, restarts = "search", 0, 0, 0
    anchor_h, anchor_kv, hold_at = None, None, None
    hist: deque = deque(maxlen=c.cycle_window)
    cycle, cycle_at = None, -1
    ds = dk = math.inf
    for n in range(1, c.max_steps + 1):
        h_new, kv = step(h)
        if not bool(torch.isfinite(h_new).all()):
            return Solve(False, n, "non-finite state", math.inf, math.inf, hold_at, restarts, h_new, kv)
        ds = rel_change(h_new, h)
        dk = kv_change(kv, prev_kv) if prev_kv is not None else (0.0 if not kv else math.inf)
        small = ds <= c.tol and dk <= c.tol
        if phase == "search":
            hold = hold + 1 if small else 0
            if hold >= c.hold_steps:
                hold_at = hold_at or n
                phase, confirm, anchor_h, anchor_kv = "confirm", 0, h_new, kv
                if c.confirm_steps == 0:
                    phase = "final"
        elif phase == "confirm":
            drift = rel_change(h_new, anchor_h)
            if kv:
                drift = max(drift, kv_change(kv, anchor_kv))
            if drift <= c.drift_tol:
                confirm += 1
                if confirm >= c.confirm_steps:
                    phase = "final"
            else:
                phase, hold, restarts = "search", 0, restarts + 1
        else:  # final one-step check
            if small:
                return Solve(True, n, "qualified", ds, dk, hold_at, restarts, h_new, kv)
            phase, hold, restarts = "search", 0, restarts + 1
        hist.append(h)
        if not small:  # name cycles: the state returns to a recent one, far closer than its step
            for p in range(2, len(hist) + 1):
                if rel_change(h_new, hist[-p]) <= min(c.drift_tol, 0.1 * ds):
                    cycle, cycle_at = p, n
                    break
        h, prev_kv = h_new, kv
    if cycle is not None and cycle_at > c.max_steps - 4 * c.cycle_window:
        reason = f"cycle of period {cycle}"
    elif restarts:
        reason = f"drift during confirmation ({restarts} failed confirmations)"
    else:
        reason = f"not converged in {c.max_steps} recurrences (last change {ds:.2e}, K/V {dk:.2e})"
    return Solve(False, c.max_steps, reason, ds, dk, hold_at, restarts, h, prev_kv)


# ----------------------------------------------------------------------------- model access
class LoopedStepper:
    """Explicit per-recurrence access to a looped :class:`MegaloopForCausalLM` (eval mode).

    Tokens ``ids`` [b, s] at absolute positions ``start..start+s-1``; ``prefix`` optionally
    holds frozen KV banks ``{(group, i): (k, v)}`` of the ``start`` earlier tokens (groups
    ``prelude``, ``core``, ``coda``), read by every layer / recurrence as terminal banks.
    """

    def __init__(self, model, ids: torch.Tensor, start: int = 0, prefix: Optional[dict] = None):
        if not model.config.looped:
            raise ConfigError("fixed-point checks need a looped model (arch=looped)")
        self.model, self.cfg = model, model.config
        ids = ids.to(next(model.parameters()).device)
        b, s = ids.shape
        positions = torch.arange(start, start + s, device=ids.device)[None].expand(b, s)
        self.p = model.begin(ids, positions=positions, past=prefix or None)
        self.prelude_kv = self.p.prelude_kv

    def init_state(self, zero: bool = False) -> torch.Tensor:
        """Evaluation-time ``h⁰`` (the model's per-position Gaussian, or zeros)."""
        return self.p.init_state(zero)

    def step(self, h: torch.Tensor) -> tuple[torch.Tensor, list[KV]]:
        """One recurrence: ``exit(core(inject(h, e)))`` and the K/V of each core layer."""
        return self.p.step(h)

    def readout(self, h: torch.Tensor, keep: int = 0) -> tuple[torch.Tensor, list[KV]]:
        """Coda → final norm → head: FP32 logits [b, s, V] (``keep`` > 0: of the last ``keep``
        positions only) and the coda layers' K/V (of every position)."""
        logits, kvs = self.p.readout(h, keep)
        return logits.float(), kvs

    def banks(self, core_kv: Sequence[KV], coda_kv: Sequence[KV]) -> dict:
        """Frozen banks of these tokens (to be read by later tokens)."""
        out = {("prelude", i): kv for i, kv in enumerate(self.prelude_kv)}
        out.update({("core", i): kv for i, kv in enumerate(core_kv)})
        out.update({("coda", i): kv for i, kv in enumerate(coda_kv)})
        return out


@contextlib.contextmanager
def reference_attention():
    """PyTorch's math (reference) SDPA kernel."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover - old torch
        yield
        return
    with sdpa_kernel(SDPBackend.MATH):
        yield


def fp32_model(model):
    """``model`` itself when FP32, else an FP32 copy."""
    if next(model.parameters()).dtype == torch.float32:
        return model.eval()
    return copy.deepcopy(model).float().eval()


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor, vocab: int) -> float:
    lp = torch.log_softmax(p_logits[..., :vocab].double(), -1)
    lq = torch.log_softmax(q_logits[..., :vocab].double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).max().clamp_min(0.0))


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative state gap ‖a − b‖ / ‖a‖ (max over tokens)."""
    return rel_change(b, a)


@torch.no_grad()
def check_span(model, ids: Sequence[int] | torch.Tensor, criteria: Optional[Criteria] = None,
               control_depth: Optional[int] = 5, zero_init: bool = True) -> dict:
    """Joint vs frozen-prefix fixed points for one span (prefix = all tokens but the last).
    ``model`` must be FP32 (see :func:`fp32_model`); runs under the math attention kernel."""
    c = criteria or Criteria()
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
    T = ids.shape[1]
    if T < 2:
        raise ConfigError("fixed-point span needs at least 2 tokens (a prefix and a current token)")
    vocab = int(model.config.tokenizer_vocab_size)
    out: dict = {"prefix_len": T - 1}
    with reference_attention():
        pre = LoopedStepper(model, ids[:, :-1])
        s_pre = solve(pre.step, pre.init_state(), c)
        joint = LoopedStepper(model, ids)
        s_joint = solve(joint.step, joint.init_state(), c)
        out["prefix"], out["joint"] = s_pre.summary(), s_joint.summary()
        # frozen prefix: banks of the solved prefix (core K/V of its last recurrence)
        _, coda_kv = pre.readout(s_pre.state, keep=1)  # only the K/V is used
        cur = LoopedStepper(model, ids[:, -1:], start=T - 1, prefix=pre.banks(s_pre.kv, coda_kv))
        s_cur = solve(cur.step, cur.init_state(), c)
        out["current"] = s_cur.summary()
        out["qualified"] = s_pre.qualified and s_joint.qualified and s_cur.qualified
        joint_logits, _ = joint.readout(s_joint.state, keep=1)  # the current token's
        cur_logits, _ = cur.readout(s_cur.state)
        h_joint = s_joint.state[:, -1:]
        out["state_gap"] = _gap(h_joint, s_cur.state)
        out["kl"] = _kl(joint_logits[:, -1], cur_logits[:, -1], vocab)
        out["prefix_gap"] = _gap(s_joint.state[:, :-1], s_pre.state)
        out["top1_agree"] = bool(joint_logits[0, -1, :vocab].argmax() == cur_logits[0, -1, :vocab].argmax())
        if zero_init:
            s_zero = solve(cur.step, cur.init_state(zero=True), c)
            out["zero_init"] = {"qualified": s_zero.qualified, "steps": s_zero.steps,
                                "state_gap": _gap(h_joint, s_zero.state)}
        if control_depth:
            h, kv = pre.init_state(), None
            for _ in range(int(control_depth)):
                h, kv = pre.step(h)
            _, ccoda = pre.readout(h, keep=1)
            ctl = LoopedStepper(model, ids[:, -1:], start=T - 1, prefix=pre.banks(kv, ccoda))
            s_ctl = solve(ctl.step, ctl.init_state(), c)
            ctl_logits, _ = ctl.readout(s_ctl.state)
            out["control"] = {"depth": int(control_depth), "qualified": s_ctl.qualified, "steps": s_ctl.steps,
                              "state_gap": _gap(h_joint, s_ctl.state),
                              "kl": _kl(joint_logits[:, -1], ctl_logits[:, -1], vocab)}
    return out


def _stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "median": None, "max": None}
    return {"n": len(values), "median": float(statistics.median(values)), "max": float(max(values))}


def _summary(rows: list[dict], control_depth: Optional[int], zero_init: bool) -> dict:
    """Counts, rejection reasons, depth / gap / KL statistics of span rows (qualified ones)."""
    q = [r for r in rows if r["qualified"]]
    out = {
        "num_spans": len(rows), "num_qualified": len(q),
        "qualified_solves": {k: sum(r[k]["qualified"] for r in rows) for k in ("prefix", "joint", "current")},
        "rejections": {k: dict(Counter(r[k]["reason"] for r in rows if not r[k]["qualified"]))
                       for k in ("prefix", "joint", "current")},
        "depth": {k: _stats([r[k]["steps"] for r in q]) for k in ("prefix", "joint", "current")},
        "state_gap": _stats([r["state_gap"] for r in q]), "kl": _stats([r["kl"] for r in q]),
        "prefix_gap": _stats([r["prefix_gap"] for r in q]),
        "top1_agreement": (sum(r["top1_agree"] for r in q) / len(q)) if q else None,
    }
    if zero_init:
        out["zero_init_state_gap"] = _stats([r["zero_init"]["state_gap"] for r in q if r["zero_init"]["qualified"]])
    if control_depth:
        ctl = [r for r in q if r["control"]["qualified"]]
        out["control"] = {"depth": int(control_depth), "qualified": len(ctl),
                          "state_gap": _stats([r["control"]["state_gap"] for r in ctl]),
                          "kl": _stats([r["control"]["kl"] for r in ctl])}
    return out


def fixed_point_report(model, spans: Sequence[Sequence[int]] | torch.Tensor, criteria: Optional[Criteria] = None,
                       control_depth: Optional[int] = 5, zero_init: bool = True, log=None,
                       sources: Optional[Sequence[str]] = None) -> dict:
    """Run :func:`check_span` on every span and summarise the qualified ones: counts, rejection
    reasons per solve, median / max solve depths, state gaps, KLs, control gaps. With
    ``sources`` (one name per span) each row records its source and ``per_source`` holds the
    same summary for every source (in first-seen order)."""
    c = criteria or Criteria()
    if sources is not None and len(sources) != len(spans):
        raise ValueError(f"fixed_point_report: {len(sources)} sources for {len(spans)} spans")
    model = fp32_model(model)
    rows = []
    for i, span in enumerate(spans):
        row = check_span(model, span, c, control_depth, zero_init)
        row["index"] = i
        if sources is not None:
            row["source"] = str(sources[i])
        rows.append(row)
        if log:
            log(row)
    report = {"criteria": asdict(c), **_summary(rows, control_depth, zero_init), "spans": rows}
    if sources is not None:
        names = list(dict.fromkeys(str(x) for x in sources))
        report["per_source"] = {n: _summary([r for r in rows if r["source"] == n], control_depth, zero_init)
                                for n in names}
    return report


def select_per_source(sources: Sequence[str], per_source: int, limit: Optional[int] = None) -> list[int]:
    """Row indices of the first ``per_source`` rows of every source (sources in first-seen
    order; the paper: 16 spans from each of 19 validation sources = 304). ``limit`` caps the
    total, taking sources round-robin so the cut stays balanced."""
    if per_source < 1:
        raise ValueError(f"per_source must be >= 1, got {per_source}")
    by_source: dict[str, list[int]] = {}
    for i, s in enumerate(sources):
        rows = by_source.setdefault(str(s), [])
        if len(rows) < per_source:
            rows.append(i)
    picked = [rows[k] for k in range(per_source) for rows in by_source.values() if k < len(rows)]
    if limit is not None:
        picked = picked[:limit]
    return sorted(picked, key=lambda i: (list(by_source).index(str(sources[i])), i))


__all__ = ["Criteria", "LoopedStepper", "Solve", "check_span", "fixed_point_report", "fp32_model", "kv_change",
           "reference_attention", "rel_change", "select_per_source", "solve"]
