"""Step-time model: per-layer-visit compute and communication, the pipeline simulated with the
run's sampled depths, then the data-parallel reduction and the optimizer. Units: seconds, FLOPs,
bytes.

Compute (per TP rank): model FLOPs of ``megaloop.train.flops`` (SPEC §6) per layer visit, head and
injection, at ``peak × cluster.gemm_efficiency`` (FP8 runs the GEMMs at the FP8 peak, attention at
bf16), plus a memory-bound part (norms, residuals, activations: twice the visit's saved bytes per pass,
and the cross-entropy's passes over the logits, at HBM bandwidth) and ``cluster.layer_overhead_us``
per visit. Backward = 2 × the forward of what
backpropagates (+ one forward of it with ``model.recompute``); no-grad recurrences are forward only.
Communication at ``bandwidth × cluster.comm_efficiency`` plus latency, exposed (megaloop builds
megatron's DDP with ``overlap_grad_reduce=False``; TP collectives are not overlapped):
TP: 2 all-reduces (or all-gather + reduce-scatter with SP) of ``[s, b, d]`` per layer visit each
way; PP: the packed ``[2s, b, d]`` tensor per microbatch and stage boundary, each way; DP: the fp32
gradient buffer reduce-scattered (distributed optimizer, then the parameters all-gathered) or
all-reduced; the core replicas' gradients all-reduced over the pipeline group (train/grads.py).
Links: intra-node when the group fits in a node (megatron's rank order tp-dp-pp), else inter-node.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from megaloop.config import RunConfig
from megaloop.plan.cluster import ClusterSpec
from megaloop.plan.layout import Layout
from megaloop.plan.memory import MemoryModel, WorkMemo, injection_params, layer_params
from megaloop.plan.pipeline_sim import SimResult, simulate
from megaloop.train.flops import forward_flops_per_token, injection_flops_per_token, microbatch_flops


@dataclass
class StepEstimate:
    """One optimizer step (seconds) and its model FLOPs."""

    sim: SimResult
    pipeline_s: float
    dp_s: float
    core_sync_s: float
    optimizer_s: float
    model_flops: float

    @property
    def step_s(self) -> float:
        return self.pipeline_s + self.dp_s + self.core_sync_s + self.optimizer_s

    @property
    def bubble(self) -> float:
        return self.sim.bubble


class CostModel:
    """Op durations and step time for one (config, layout, cluster, vocab)."""

    def __init__(self, cfg: RunConfig, layout: Layout, cluster: ClusterSpec, vocab: int,
                 memory: MemoryModel | None = None):
        self.cfg, self.layout, self.cluster = cfg, layout, cluster
        self.mem = memory or MemoryModel(cfg, layout, cluster, vocab)
        m = cfg.model
        self.V = m.padded_vocab(vocab)
        self.tokens = m.seq_len * layout.micro_batch
        d, s = m.hidden_size, m.seq_len
        self.attn = 2.0 * 2 * s * d  # QKᵀ and AV per token (flops.layer_flops_per_token's attention)
        once, per_rec, head = forward_flops_per_token(m, self.V, s, 1)
        layer = (per_rec - injection_flops_per_token(m)) / m.n_core if m.looped else once / m.num_layers
        self.layer = layer
        self.inj = injection_flops_per_token(m) if m.looped else 0.0
        self.prepare = once - (m.n_prelude + m.n_coda) * layer if m.looped else 0.0
        self.head = head
        # (kind, stage, depth) -> seconds, shared by what the stage runs, not which stage or depth
        self._op = WorkMemo(self.mem.work_key, self._op_time)

    # ------------------------------------------------------------------ links
    def _bw(self, intra: bool) -> float:
        c = self.cluster
        return (c.intra_node_gbps if intra else c.inter_node_gbps) * 1e9 * c.comm_efficiency

    def allreduce_s(self, nbytes: float, n: int, intra: bool) -> float:
        if n <= 1:
            return 0.0
        return 2 * (n - 1) / n * nbytes / self._bw(intra) + self.cluster.collective_latency_us * 1e-6

    def tp_intra(self) -> bool:
        return self.layout.tp <= self.cluster.gpus_per_node

    def p2p_s(self) -> float:
        """One PP transfer of the packed [2s, b, d] tensor (bytes / tp with SP)."""
        L, D = self.layout, self.mem.dims
        if L.pp == 1:
            return 0.0
        width = 2 if self.cfg.model.looped else 1
        nbytes = width * self.tokens * D.d * D.a / D.rep
        intra = L.tp * L.dp * L.pp <= self.cluster.gpus_per_node
        return nbytes / self._bw(intra) + self.cluster.p2p_latency_us * 1e-6

    # ------------------------------------------------------------------ ops
    def flops(self, kind: str, v: int, depth: int) -> tuple[float, float]:
        """(GEMM, attention) FLOPs of op ``kind`` on virtual stage ``v`` for one TP rank."""
        m, L = self.cfg.model, self.layout
        w = self.mem.work(depth)[v]
        if m.looped:
            rec = w.recurrences if kind == "F" else w.grad_recurrences
            visits = rec * m.n_core + (m.n_prelude if w.first else 0) + (m.n_coda if w.last else 0)
            extra = rec * self.inj + (self.prepare if (kind == "F" or w.grad_recurrences) else 0.0)
        else:
            visits = w.recurrences
            extra = 0.0
        gemm = visits * (self.layer - self.attn) + extra + (self.head if w.last else 0.0)
        attn = visits * self.attn
        mult = 1.0 if kind == "F" else (3.0 if L.recompute else 2.0)
        return mult * gemm * self.tokens / L.tp, mult * attn * self.tokens / L.tp

    def visits(self, kind: str, v: int, depth: int) -> int:
        m = self.cfg.model
        w = self.mem.work(depth)[v]
        if not m.looped:
            return w.recurrences
        rec = w.recurrences if kind == "F" else w.grad_recurrences
        return rec * m.n_core + (m.n_prelude if w.first else 0) + (m.n_coda if w.last else 0)

    def mem_bytes(self, kind: str, v: int, depth: int) -> float:
        """Memory-bound traffic of an op: each visit writes and reads back what it saves (norms,
        residuals, activation functions) per pass, and the last stage's cross-entropy makes ~8
        (forward) / ~6 (backward) passes over the fp32 logits."""
        L, D = self.layout, self.mem.dims
        passes = 1 if kind == "F" else (3 if L.recompute else 2)
        out = passes * self.visits(kind, v, depth) * 2 * self.mem.layer_bytes(recompute=False) * self.tokens
        if v == L.stages - 1:
            out += self.tokens * D.V / D.tp * 4 * (8 if kind == "F" else 6)
        return out

    def op_s(self, kind: str, v: int, depth: int) -> float:
        """Duration of F or B of one microbatch of ``depth`` on virtual stage ``v`` (seconds)."""
        return self._op(kind, v, depth)

    def _op_time(self, kind: str, v: int, depth: int) -> float:
        c, L = self.cluster, self.layout
        gemm, attn = self.flops(kind, v, depth)
        peak_gemm = c.peak_tflops(L.fp8) * 1e12 * c.gemm_efficiency
        peak_attn = c.peak_bf16_tflops * 1e12 * c.gemm_efficiency
        n = self.visits(kind, v, depth)
        membound = self.mem_bytes(kind, v, depth) / (c.hbm_gbps * 1e9)
        d, a = self.cfg.model.hidden_size, self.mem.dims.a
        tp_bytes = self.tokens * d * a
        tp_comm = (1 if kind == "F" else (2 if L.recompute else 1)) * 2 * n * self.allreduce_s(tp_bytes, L.tp, self.tp_intra())
        return gemm / peak_gemm + attn / peak_attn + membound + n * c.layer_overhead_us * 1e-6 + tp_comm

    # ------------------------------------------------------------------ step
    def dp_s(self) -> float:
        L, c = self.layout, self.cluster
        if L.dp == 1:
            return 0.0
        n = max(self.mem.rank_params(k) for k in range(L.pp))
        intra = L.tp * L.dp <= c.gpus_per_node
        half = (L.dp - 1) / L.dp / self._bw(intra)
        lat = c.collective_latency_us * 1e-6
        if L.distributed_optimizer:
            return half * 4 * n + half * self.mem.dims.a * n + 2 * lat  # reduce-scatter + all-gather
        return 2 * half * 4 * n + lat

    def core_sync_s(self) -> float:
        m, L = self.cfg.model, self.layout
        if not m.looped or L.pp == 1:
            return 0.0
        core = m.n_core * layer_params(self.cfg, L.tp) + injection_params(self.cfg, L.tp)
        return self.allreduce_s(4 * core, L.pp, L.tp * L.dp * L.pp <= self.cluster.gpus_per_node)

    def optimizer_s(self) -> float:
        L = self.layout
        n = max(self.mem.rank_params(k) for k in range(L.pp)) / (L.dp if L.distributed_optimizer else 1)
        return 36.0 * n / (self.cluster.hbm_gbps * 1e9)  # grads, master weights, 2 moments, params r/w

    def step(self, depths: list[int]) -> StepEstimate:
        L, m = self.layout, self.cfg.model
        op, op_s = self._op.by_key, self.op_s

        def dur(kind: str, mb: int, v: int) -> float:
            t = op.get((kind, v, depths[mb]))
            return op_s(kind, v, depths[mb]) if t is None else t

        sim = simulate(L.pp, len(depths), dur, vpp=L.vpp, transfer=self.p2p_s())
        flops = sum(microbatch_flops(m, self.V, m.seq_len, self.tokens, r, m.bptt_window) for r in depths) * L.dp
        return StepEstimate(sim=sim, pipeline_s=sim.makespan, dp_s=self.dp_s(), core_sync_s=self.core_sync_s(),
                            optimizer_s=self.optimizer_s(), model_flops=flops)

    def peak_flops(self) -> float:
        """Dense peak FLOP/s per GPU of the precision the layout's GEMMs run in: the FP8 peak for an
        FP8 layout, else bf16. MFU is reported against it (against the bf16 peak an FP8 run could
        exceed 100 %); the trainer's logged ``mfu`` uses the bf16 peak (``mfu_vs_bf16``)."""
        return self.cluster.peak_tflops(self.layout.fp8) * 1e12

    def mfu(self, est: StepEstimate) -> float:
        """Model FLOPs / (step time × GPUs × :meth:`peak_flops`)."""
        return est.model_flops / (est.step_s * self.layout.world * self.peak_flops())

    def fixed_s(self) -> float:
        """The step's parts that do not depend on the depths: DP reduce, core sync, optimizer."""
        return self.dp_s() + self.core_sync_s() + self.optimizer_s()

    def expected_microbatch(self, law: list[tuple[int, float]]) -> tuple[float, float]:
        """Over the depth law ``[(depth, p)]``: the expected compute seconds of one microbatch
        (its F and B on every virtual stage, summed) and its expected model FLOPs. Exact."""
        f, b = self.expected_ops(law)
        m = self.cfg.model
        flops = sum(p * microbatch_flops(m, self.V, m.seq_len, self.tokens, r, m.bptt_window) for r, p in law)
        return sum(f) + sum(b), flops

    def expected_ops(self, law: list[tuple[int, float]]) -> tuple[list[float], list[float]]:
        """Expected F and B seconds of one microbatch on each virtual stage over the depth law."""
        S = self.layout.stages
        f, b = [0.0] * S, [0.0] * S
        for r, p in law:
            for v in range(S):
                f[v] += p * self.op_s("F", v, r)
                b[v] += p * self.op_s("B", v, r)
        return f, b

    def makespan_bound(self, first_f: list[float], last_b: list[float], one_f: list[float], one_b: list[float],
                       busy: list[float]) -> float:
        """A lower bound of the pipeline's makespan, from per-virtual-stage op times: ``first_f`` =
        F of the first microbatch, ``last_b`` = B of the last, ``one_f`` / ``one_b`` = F and B of any
        one microbatch, ``busy`` = each pipeline rank's total compute. Every step satisfies it
        (tests/plan/test_search.py); with expectations over the depth law it bounds the expected
        makespan (the bound is linear in the op times, so expectation passes through).

        * one microbatch's path: F on every virtual stage, then B back, one transfer per hop;
        * rank k: its first op is the first microbatch's F on virtual stage k (after stages 0..k-1
          forwarded it), then it computes ``busy[k]``; without interleaving its last op is the last
          microbatch's B, which stages k-1..0 then run too."""
        L = self.layout
        pp, S, hop = L.pp, L.stages, self.p2p_s()
        out = sum(one_f) + sum(one_b) + 2 * (S - 1) * hop
        for k in range(pp):
            t = sum(first_f[:k]) + k * hop + busy[k]
            if L.vpp == 1:
                t += sum(last_b[:k]) + k * hop
            out = max(out, t)
        return out

    def expected_step_bound(self, law: list[tuple[int, float]]) -> float:
        """A lower bound of the expected step time over the depth law (no sampling): the makespan
        bound at expected op times plus the step's fixed parts."""
        L = self.layout
        f, b = self.expected_ops(law)
        busy = [L.microbatches * sum(f[c * L.pp + k] + b[c * L.pp + k] for c in range(L.vpp)) for k in range(L.pp)]
        return self.makespan_bound(f, b, f, b, busy) + self.fixed_s()


def summarize(values: list[float]) -> dict[str, float]:
    """mean, std, min, max (and p10/p90 with >= 10 values)."""
    out = {"n": len(values), "mean": statistics.fmean(values), "std": statistics.pstdev(values) if len(values) > 1 else 0.0,
           "min": min(values), "max": max(values)}
    if len(values) >= 10:
        q = statistics.quantiles(values, n=10)
        out.update(p10=q[0], p90=q[-1])
    return out
