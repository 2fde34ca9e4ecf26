"""Memory per rank of a looped-LM training layout. Units: bytes (reports in GiB).

Static (per pipeline rank = the sum over its model chunks; TP-sharded weights divided by TP):
parameters (bf16: 2 B, fp32: 4 B; FP8 adds a 1-B weight copy), gradients (megatron DDP's fp32 grad
buffer, 4 B), Adam state (8 B; + 4 B fp32 master weights with bf16), the optimizer part divided by
DP with the distributed optimizer.

Activations of one microbatch of depth r on virtual stage v (:meth:`MemoryModel.held`): only
layer visits that backpropagate keep tensors for backward: the TBPTT window's recurrences that
fall on v (``stages.stage_work``), the prelude on stage 0, the coda on the last stage; so they are
flat in r. No-grad recurrences only need one layer's working set (a transient). Stage 0 adds the
embedding's ids and the injection's prepared input, the last stage the final norm and the
cross-entropy's fp32 softmax ``[s, b, V/tp]`` (the logit buffer); pipeline stages hold their
received ``[2s, b, d]`` input and their sent output per in-flight microbatch (megaloop keeps
``deallocate_pipeline_outputs=False``).

Per-layer-visit saved bytes per token (``a`` = activation bytes, ``t`` = TP; ``/t`` also on the
replicated part under sequence parallelism):
* ``local`` (megatron local spec, SDPA, torch RMSNorm; counted from the tensors autograd saves in
  one layer, fp32 and bf16, see tests/plan/test_memory.py): fp32 ``20d + 8 + (16d + 12kv + 20f + 4h)/t``,
  bf16 ``22d + 8 + (6d + 6kv + 10f + 4h)/t`` (norms keep fp32 copies on CPU); used with
  ``model.transformer_impl=local`` or ``cluster.activation_profile=local``;
* ``te`` (Transformer Engine, GPU; an assumption read from TE's modules, not measured here):
  ``a/2·8d + 8 + (a/2·(6d + 6kv + 6f) + 4h)/t``;
* ``model.qk_norm`` adds ``(c_q·d + c_k·kv + 4·(h + g))/t`` (g: KV groups): the norms keep q and
  k and an fp32 rstd per head. ``te``: c_q = c_k = a (TE's RMSNorm keeps its input). ``local``
  (what autograd saves, ``tests/plan/test_memory.py``): bf16 c_q = c_k = 8 (fp32 copies of the
  bf16 input); fp32 c_k = 4, c_q = 4 with MHA and 8 with GQA (the regrouped query is a copy kept
  besides the norm's input);
* ``model.recompute``: only each visit's input ``a·d``.

The peak of a pipeline rank replays its schedule (``pipeline_sim.inflight_order``): activations
are held from a microbatch-chunk's F to its B; the peak adds the op's transient (one layer's
forward working set, the logits, backward gradient buffers and the largest weight gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from megaloop.config import RunConfig
from megaloop.plan.cluster import ClusterSpec
from megaloop.plan.layout import Layout
from megaloop.plan.pipeline_sim import inflight_order
from megaloop.plan.stages import StageTable

GiB = float(2**30)


class WorkMemo:
    """Two-level memo of ``compute(*key)``, ``key`` = ``(stage, depth)`` or ``(kind, stage, depth)``:
    per key, and shared by the keys whose stage runs the same work (``work_key(*key)``, as
    :meth:`MemoryModel.work_key`), so each distinct work is computed once (a search asks for few
    works at many stages and depths). ``by_key`` is the first level, for a hot loop to read directly."""

    def __init__(self, work_key, compute):
        self.work_key, self.compute = work_key, compute
        self.by_key: dict = {}
        self.by_work: dict = {}

    def __call__(self, *key):
        got = self.by_key.get(key)
        if got is None:
            wkey = self.work_key(*key)
            got = self.by_work.get(wkey)
            if got is None:
                got = self.by_work[wkey] = self.compute(*key)
            self.by_key[key] = got
        return got


@dataclass(frozen=True)
class Dims:
    """Shapes of one TP rank: widths in channels, ``V`` padded vocab, ``tokens`` per microbatch."""

    d: int
    f: int
    kv: int
    heads: int
    head_dim: int
    V: int
    s: int
    tokens: int
    tp: int
    sp: bool
    a: int  # activation / param bytes (2: bf16, 4: fp32)

    @property
    def rep(self) -> int:
        """Divisor of the TP-replicated activations (TP with sequence parallelism, else 1)."""
        return self.tp if self.sp else 1


def dims_of(cfg: RunConfig, layout: Layout, vocab: int) -> Dims:
    m = cfg.model
    return Dims(d=m.hidden_size, f=m.ffn_size, kv=m.hidden_size * m.groups // m.num_heads, heads=m.num_heads,
                head_dim=m.hidden_size // m.num_heads, V=m.padded_vocab(vocab), s=m.seq_len,
                tokens=m.seq_len * layout.micro_batch, tp=layout.tp, sp=layout.sequence_parallel,
                a=2 if m.bf16 else 4)


def layer_params(cfg: RunConfig, tp: int) -> float:
    """Parameters of one transformer layer on one TP rank (norm gains replicated)."""
    m = cfg.model
    d, f = m.hidden_size, m.ffn_size
    kv = d * m.groups // m.num_heads
    qk_gains = 2 * (d // m.num_heads) if m.qk_norm else 0  # per-head-dim q and k norm gains
    return (d * (d + 2 * kv) + d * d + 3 * d * f + ((d + kv) if m.qk_bias else 0)) / tp + 2 * d + qk_gains


def injection_params(cfg: RunConfig, tp: int) -> float:
    """Injection parameters per stage (replicated over TP; DEQ-QKV's projections are TP-split)."""
    m = cfg.model
    d = m.hidden_size
    kv = d * m.groups // m.num_heads
    if not m.looped:
        return 0.0
    return {"huginn_linear": 2 * d * d + (d if m.adapter_bias else 0), "deq_qkv": m.n_core * d * (d + 2 * kv) / tp,
            "parcae_decay": d * d + 3 * d}.get(m.injection, d * d + 2 * d)


def stage_params(cfg: RunConfig, layout: Layout, vocab: int) -> list[dict[str, float]]:
    """Parameter counts of each virtual stage on one TP rank, by component."""
    m = cfg.model
    t, S = layout.tp, layout.stages
    lp = layer_params(cfg, t)
    V = m.padded_vocab(vocab)
    out = []
    for v in range(S):
        first, last = v == 0, v == S - 1
        p = {"embedding": V * m.hidden_size / t if first else 0.0}
        if m.looped:
            p["layers"] = lp * (m.n_core + (m.n_prelude if first else 0) + (m.n_coda if last else 0))
            p["injection"] = injection_params(cfg, t)
        else:
            p["layers"] = lp * (m.num_layers // S)
        head = last and not (m.tie_embeddings and S == 1)
        p["head"] = (V * m.hidden_size / t if head else 0.0) + (m.hidden_size if last else 0.0)
        if last and m.looped and m.state_readout:
            p["head"] += m.hidden_size * m.hidden_size  # readout C (replicated over TP)
        out.append(p)
    return out


class MemoryModel:
    """Bytes per pipeline rank for one (config, layout, cluster, vocab)."""

    def __init__(self, cfg: RunConfig, layout: Layout, cluster: ClusterSpec, vocab: int):
        self.cfg, self.layout, self.cluster = cfg, layout, cluster
        self.dims = dims_of(cfg, layout, vocab)
        # megatron's local spec where the model asks for it, else the cluster's (te on GPU clusters)
        self.profile = "local" if cfg.model.transformer_impl == "local" else cluster.activation_profile
        self.stage_params = stage_params(cfg, layout, vocab)
        self.work = StageTable(cfg.model, layout.stages, self.dims.V)  # depth -> per-stage work
        # what a stage holds or needs depends on its work (recurrences run / backpropagated, first, last stage)
        self._held = WorkMemo(partial(self.work_key, "held"), self._held_bytes)
        self._transient = WorkMemo(self.work_key, self._transient_bytes)

    # ------------------------------------------------------------------ static
    def rank_params(self, rank: int) -> float:
        L = self.layout
        return sum(sum(self.stage_params[c * L.pp + rank].values()) for c in range(L.vpp))

    def static(self, rank: int) -> dict[str, float]:
        """Parameters, gradients and optimizer state of pipeline rank ``rank`` (bytes)."""
        L, m = self.layout, self.cfg.model
        n = self.rank_params(rank)
        pbytes = self.dims.a + (1 if L.fp8 else 0)
        opt = (8 + (4 if m.bf16 else 0)) * n / (L.dp if L.distributed_optimizer else 1)
        return {"params": n * pbytes, "grads": 4.0 * n, "optimizer": opt, "param_count": n}

    # ------------------------------------------------------------------ activations
    def layer_bytes(self, recompute: bool | None = None) -> float:
        """Saved bytes per token of one backpropagated layer visit (profile formulas above)."""
        D = self.dims
        d, f, kv, h, t, a = D.d, D.f, D.kv, D.heads, D.tp, D.a
        if self.layout.recompute if recompute is None else recompute:
            return a * d / D.rep
        if self.profile == "local":
            rep, split = (20 * d + 8, 16 * d + 12 * kv + 20 * f + 4 * h) if a == 4 else \
                (22 * d + 8, 6 * d + 6 * kv + 10 * f + 4 * h)
            if self.cfg.model.local_attention == "megatron":  # explicit [b, n, s, s] scores and probs (not validated)
                split += 2 * a * h * D.s
        else:
            rep, split = a / 2 * 8 * d + 8, a / 2 * (6 * d + 6 * kv + 6 * f) + 4 * h
        if self.cfg.model.qk_norm:  # q, k kept by their norms (fp32 on CPU) + an fp32 rstd per head and group
            if self.profile != "local":
                c_q = c_k = a
            else:
                c_k = 4 if a == 4 else 8
                c_q = 8 if a == 2 or kv < d else 4
            split += c_q * d + c_k * kv + 4 * (h + kv // D.head_dim)
        return rep / D.rep + split / t

    def injection_bytes(self) -> float:
        """Saved bytes per token of one backpropagated recurrence's injection (beyond its layers)."""
        D, inj = self.dims, self.cfg.model.injection
        per = {"parcae_decay": D.a * D.d, "parcae_nonorm": D.a * D.d, "deq_qkv": 0.0,
               "huginn_linear": 2 * D.a * D.d + 8 * D.d + 4}.get(inj, D.a * D.d + 12 * D.d)
        return per / D.rep

    def held(self, v: int, depth: int) -> float:
        """Bytes kept from F to B by one microbatch of ``depth`` on virtual stage ``v``."""
        return self._held(v, depth)

    def _held_bytes(self, v: int, depth: int) -> float:
        return sum(self.held_parts(v, depth).values())

    def held_parts(self, v: int, depth: int) -> dict[str, float]:
        """:meth:`held` by part: ``window`` (the backpropagated recurrences' layer visits and
        injections), ``prelude_coda`` (their layer visits), ``logits`` (final norm and the CE's fp32
        softmax, i.e. the logit buffer), ``pipeline`` (received input, sent output), ``other``."""
        m, D, S = self.cfg.model, self.dims, self.layout.stages
        w = self.work(depth)[v]
        first, last = w.first, w.last
        lb, tok = self.layer_bytes(), D.tokens
        if m.looped:
            outer = (m.n_prelude if first else 0) + (m.n_coda if last else 0)
            window = w.grad_recurrences * m.n_core
        else:
            outer, window = 0, w.grad_recurrences
        rope = 0.0
        if self.profile == "local" and not self.layout.recompute:
            rope = 4 * D.s * D.head_dim * D.a  # cos/sin tables kept per visit
        parts = {"window": window * (tok * lb + rope), "prelude_coda": outer * (tok * lb + rope),
                 "logits": tok * self._head_saved() if last else 0.0, "pipeline": 0.0, "other": 0.0}
        if m.looped:
            parts["window"] += tok * w.grad_recurrences * self.injection_bytes()
            if w.grad_recurrences and (first or D.a == 2):
                parts["other"] += tok * 4 * D.d / D.rep  # the injection's prepared fp32 input (prepare(e))
        if first:
            parts["other"] += tok * 8  # token ids kept by the embedding
        if S > 1:
            width = 2 if m.looped else 1  # packed [h; e]
            parts["pipeline"] = tok * width * D.a * D.d / D.rep * ((v > 0) + (v < S - 1))
        return parts

    def work_key(self, kind: str, v: int, depth: int) -> tuple:
        """What an F/B op's cost depends on: its kind and what virtual stage ``v`` runs at ``depth``
        (recurrences, backpropagated ones, first/last stage), not the stage or depth themselves."""
        w = self.work(depth)[v]
        return (kind, w.recurrences, w.grad_recurrences, w.first, w.last)

    def transient(self, kind: str, v: int, depth: int) -> float:
        """Extra bytes live during an F or B op beyond what is held (working set, logits, grads)."""
        return self._transient(kind, v, depth)

    def _transient_bytes(self, kind: str, v: int, depth: int) -> float:
        m, D, S = self.cfg.model, self.dims, self.layout.stages
        w = self.work(depth)[v]
        t, a, d = D.tp, D.a, D.d
        pbytes = D.a
        runs_layers = w.recurrences > 0 or (w.first and m.n_prelude) or (w.last and (m.n_coda or not m.looped))
        if kind == "F":
            work = D.tokens * a * (3 * d / D.rep + 4 * D.f / t) if runs_layers else 0.0
            # the CE works in place on fp32 logits; bf16 logits live beside their fp32 copy
            head = D.tokens * a * D.V / t if (w.last and a == 2) else 0.0
            return max(work, head)
        # backward runs the head first (all activations still held), then the layers last to first;
        # by the first layer's backward the head's saved tensors (softmax, final norm) are released
        layer = D.tokens * a * (2 * d / D.rep + 4 * D.f / t) + 2 * D.f * d / t * pbytes
        if self.layout.recompute:
            layer += D.tokens * self.layer_bytes(recompute=False)  # one visit recomputed
        head = 0.0
        if w.last:
            head = D.V * d / t * pbytes + (D.tokens * a * D.V / t if a == 2 else 0)
            layer -= D.tokens * self._head_saved()
        width = 2 if m.looped else 1
        pp_grads = D.tokens * width * a * d / D.rep * ((v > 0) + (v < S - 1))
        return max(layer, head, 0.0) + pp_grads

    def _head_saved(self) -> float:
        """Saved bytes per token of the final norm and the cross-entropy (last stage)."""
        D = self.dims
        return (12 * D.d if D.a == 4 else 10 * D.d) / D.rep + 4 + 4 * D.V / D.tp + 9

    # ------------------------------------------------------------------ peaks
    def rank_peak(self, rank: int, depths: list[int]) -> dict[str, float]:
        """Peak activation bytes of pipeline rank ``rank`` over one step whose microbatch ``i``
        has depth ``depths[i]`` (schedule order of megatron's 1F1B / interleaved)."""
        L = self.layout
        order = inflight_order(L.pp, len(depths), L.vpp)[rank]
        return self._replay(order, rank, lambda mb: depths[mb], {})

    def rank_worst(self, rank: int, support: list[int]) -> dict[str, float]:
        """Upper bound of the peak over any depths in ``support``: every in-flight microbatch at
        its stage's worst depth."""
        L = self.layout
        order = inflight_order(L.pp, L.microbatches, L.vpp)[rank]
        return self._replay(order, rank, None, {"support": support})

    def _replay(self, order, rank: int, depth_of, opts: dict) -> dict[str, float]:
        L = self.layout
        held = peak = peak_held = 0.0
        inflight = peak_inflight = 0
        worst_cache: dict = {}

        def amounts(kind: str, v: int, mb: int) -> tuple[float, float]:
            if depth_of is not None:
                r = depth_of(mb)
                return self.held(v, r), self.transient(kind, v, r)
            key = (kind, v)
            if key not in worst_cache:
                sup = opts["support"]
                worst_cache[key] = (max(self.held(v, r) for r in sup), max(self.transient(kind, v, r) for r in sup))
            return worst_cache[key]

        for kind, mb, c in order:
            v = c * L.pp + rank
            h, tr = amounts(kind, v, mb)
            if kind == "F":
                if held + h + tr > peak:
                    peak, peak_held, peak_inflight = held + h + tr, held + h, inflight + 1
                held += h
                inflight += 1
            else:
                if held + tr > peak:
                    peak, peak_held, peak_inflight = held + tr, held, inflight
                held -= h
                inflight -= 1
        return {"activations": peak_held, "transient": peak - peak_held, "peak": peak, "in_flight": peak_inflight}

    def optimizer_phase(self, rank: int) -> float:
        """Transient bytes after the last backward: core-replica gradient sync buffers (grads.py)
        and optimizer temporaries (``cluster.optimizer_temp_bytes`` per optimizer-owned parameter)."""
        L, m = self.layout, self.cfg.model
        n = self.rank_params(rank)
        local = n / (L.dp if L.distributed_optimizer else 1)
        sync = 0.0
        if m.looped and (L.pp > 1 or L.vpp > 1):
            core = m.n_core * layer_params(self.cfg, L.tp) + injection_params(self.cfg, L.tp)
            sync = 2 * 4.0 * core
        return sync + self.cluster.optimizer_temp_bytes * local

    def rank_total(self, rank: int, act: dict[str, float]) -> dict[str, float]:
        """Static + dynamic (× fragmentation) + reserved for one rank; bytes."""
        st = self.static(rank)
        c = self.cluster
        dyn = max(act["peak"], self.optimizer_phase(rank))
        total = st["params"] + st["grads"] + st["optimizer"] + c.fragmentation * dyn + c.reserved_gib * GiB
        return {**st, **act, "dynamic": dyn, "overhead": (c.fragmentation - 1) * dyn + c.reserved_gib * GiB,
                "total": total}


def stage_names(layout: Layout, rank: int, looped: bool = True) -> str:
    """Human description of what pipeline rank ``rank`` holds."""
    S = layout.stages
    parts = []
    for c in range(layout.vpp):
        v = c * layout.pp + rank
        what = ["core"] if looped else ["layers"]
        if v == 0:
            what.insert(0, "embedding+prelude" if looped else "embedding")
        if v == S - 1:
            what.append("coda+head" if looped else "head")
        parts.append(f"stage {v} ({'+'.join(what)})")
    return ", ".join(parts)
