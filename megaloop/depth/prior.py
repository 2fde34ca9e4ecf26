"""Learned categorical depth prior with PopArt-scaled advantages (SPEC §5, paper Algorithm 2).

``p_φ = softmax(φ)`` over depths ``1..r_max`` (inactive depths masked out of support). One
:meth:`LearnedDepthPrior.update` per optimizer step, fed the step's depths and the GLOBAL (already
all-reduced over data-parallel ranks) per-microbatch CE sums and target counts:

1. ``ℓ_i = S_i / N_i``; step averages ``Ê[χ] = Σ N_i χ_i / Σ N_i``.
2. ``u_i = ω(ℓ_i)``: ``exp`` ``e^{-ℓ}`` | ``neglog`` ``-log max(ℓ,1e-12)`` | ``negexp`` ``-e^{ℓ}``;
   ``raw_ce`` uses ``A_i = -(ℓ_i - ℓ̂)`` with ``ℓ̂ = μ_ℓ`` and no PopArt scale.
3. ``A_i = s (u_i - μ_u)`` with pre-step ``s = σ_ℓ/σ_u`` (EMA moments, stds floored at 1e-12).
4. ``L(φ) = -Ê[A_i log p(r_i)] - λ_H H(p) + λ_m (E_p[r] - R̄)²`` (regularisers exact over active depths),
   one step of a separate Adam on ``φ`` — unless in warm-up, frozen, or on the initialising first step.
5. EMA moments updated after the step with decay ``ν``.

This module knows depths and losses only: no model or trainer imports.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch

from megaloop.config_utils import require
from megaloop.depth.config import DepthConfig
from megaloop.depth.distributions import categorical_entropy, categorical_mean, pln_probs

__all__ = ["LearnedDepthPrior", "as_float64", "per_depth_ce"]

_STD_FLOOR = 1e-12
_STAT_KEYS = ("mu_ce", "m_ce", "mu_u", "m_u")


def as_float64(x: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Detached float64 CPU copy of a tensor or sequence (accepts CUDA tensors)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    return torch.tensor([float(v) for v in x], dtype=torch.float64)


def per_depth_ce(depths: Sequence[int], ce_sums: torch.Tensor, counts: torch.Tensor) -> dict[int, float]:
    """Token-weighted mean CE per distinct depth of the step: ``{r: Σ_{r_i=r} S_i / Σ_{r_i=r} N_i}`` (nats)."""
    out: dict[int, float] = {}
    for r in sorted(set(int(d) for d in depths)):
        sel = torch.tensor([int(d) == r for d in depths])
        n = float(counts[sel].sum())
        if n > 0:
            out[r] = float(ce_sums[sel].sum()) / n
    return out


def _reward(ce: torch.Tensor, arm: str) -> torch.Tensor:
    """Reward ``u = ω(ℓ)`` per microbatch; for ``raw_ce`` the tracked 'reward' is ``-ℓ`` (choice)."""
    if arm == "exp":
        return torch.exp(-ce)
    if arm == "neglog":
        return -torch.log(ce.clamp_min(1e-12))
    if arm == "negexp":
        return -torch.exp(ce)
    return -ce  # raw_ce: its advantage uses the CE baseline directly, see update()


class LearnedDepthPrior:
    """Categorical prior over depths ``1..r_max`` with a PopArt-scaled REINFORCE update.

    State (all in :meth:`state_dict`): float64 logits ``[r_max]``, Adam state, EMA moments
    ``μ_ℓ, m_ℓ, μ_u, m_u`` (CE in nats per token), and the update counter.

    (choice) Warm-up counts every update including the initialising first one, so logits first
    move at update ``max(warmup_updates, 1) + 1`` (update 33 by default). Inactive logits get zero
    gradient, hence zero Adam moments, and never change. The prior lives on the CPU in float64.
    """

    def __init__(self, cfg: DepthConfig, init_state: dict[str, Any] | None = None) -> None:
        """``init_state`` (``depth.init=from:PATH``, read by :mod:`megaloop.train.prior_init`): logits and
        active support to start from; ``None`` with ``from:`` starts uniform until a checkpoint of this
        run is loaded (resume), which brings its own logits and support."""
        require(cfg.kind == "learned", "depth.kind", f"LearnedDepthPrior needs kind='learned', got {cfg.kind!r}")
        self.cfg = cfg
        r_max = cfg.r_max
        self.active = torch.ones(r_max, dtype=torch.bool)
        self.init_source: str | None = None
        if cfg.init_from is not None:
            init = torch.zeros(r_max, dtype=torch.float64)
            if init_state is not None:
                self.active = init_state["active"].clone()
                init = init_state["logits"].clone()
                self.init_source = init_state.get("checkpoint")
                on = torch.nonzero(self.active).flatten()
                lo, hi = int(on.min()) + 1, int(on.max()) + 1
                require(lo <= cfg.target_mean <= hi, "depth.target_mean",
                        f"{cfg.target_mean:g} is outside the support {lo}..{hi} that {cfg.init} starts from (the mean "
                        "penalty would pile the prior onto its edge); give one inside it")
        elif cfg.init == "pln":
            init = pln_probs(cfg.mean, cfg.sigma, r_max).log()  # φ₀ = log p_PLN capped at r_max
        elif cfg.init == "uniform":
            init = torch.zeros(r_max, dtype=torch.float64)
        else:  # uniform_1_10: depths 11..r_max inactive (masked out of support and of every regulariser)
            init = torch.zeros(r_max, dtype=torch.float64)
            self.active[10:] = False
        self._active_idx = torch.nonzero(self.active).flatten()
        self.logits = torch.nn.Parameter(init.clone())
        self.optimizer = torch.optim.Adam(
            [self.logits], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, weight_decay=0.0, foreach=False
        )
        self.num_updates = 0  # update() calls so far (including warm-up and the initialising step)
        self.num_logit_steps = 0  # Adam steps actually applied to φ
        self.stats: dict[str, float] = {k: 0.0 for k in _STAT_KEYS}

    # ---- distribution -------------------------------------------------------------------------
    def probs(self) -> torch.Tensor:
        """``p_φ`` over depths ``1..r_max`` (float64 ``[r_max]``, zero at inactive depths)."""
        with torch.no_grad():
            p = torch.zeros(self.cfg.r_max, dtype=torch.float64)
            p[self._active_idx] = torch.softmax(self.logits[self._active_idx], 0)
        return p

    def mean_depth(self) -> float:
        return categorical_mean(self.probs())

    def entropy(self) -> float:
        return categorical_entropy(self.probs())

    # ---- PopArt statistics --------------------------------------------------------------------
    @staticmethod
    def _std(mu: float, m: float) -> float:
        return max(math.sqrt(max(m - mu * mu, 0.0)), _STD_FLOOR)

    @property
    def scale(self) -> float:
        """PopArt scale ``s = σ_ℓ / σ_u`` the next update will use (1 before any statistics; 1 for raw_ce)."""
        if self.num_updates == 0 or self.cfg.reward == "raw_ce":
            return 1.0
        st = self.stats
        return self._std(st["mu_ce"], st["m_ce"]) / self._std(st["mu_u"], st["m_u"])

    @property
    def baseline(self) -> float:
        """Baseline the next update will use: ``μ_u`` (reward arms) or ``ℓ̂ = μ_ℓ`` (raw_ce)."""
        return self.stats["mu_ce"] if self.cfg.reward == "raw_ce" else self.stats["mu_u"]

    # ---- update -------------------------------------------------------------------------------
    def loss(self, depths: Sequence[int], adv: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Prior loss ``L(φ)`` (scalar, differentiable in :attr:`logits` only).

        ``adv``/``weights`` are float64 ``[M]``; ``weights`` are ``N_i / Σ N`` (sum to 1).
        """
        cfg = self.cfg
        act = self._active_idx
        logp_act = torch.log_softmax(self.logits[act], 0)  # [A]
        p_act = logp_act.exp()
        pos = {int(d): i for i, d in enumerate(act.tolist())}
        sel = torch.tensor([pos[int(r) - 1] for r in depths], dtype=torch.long)
        pg = -(weights * adv * logp_act[sel]).sum()
        ent = -(p_act * logp_act).sum()
        mean = (p_act * (act.to(torch.float64) + 1.0)).sum()
        return pg - cfg.entropy_coef * ent + cfg.mean_coef * (mean - cfg.target_mean) ** 2

    def update(
        self,
        depths: Sequence[int],
        ce_sums: torch.Tensor | Sequence[float],
        counts: torch.Tensor | Sequence[float],
    ) -> dict[str, Any]:
        """One prior update after an optimizer step.

        Args:
            depths: ``[M]`` depths ``r_i`` the step's microbatches ran at (all must be active).
            ce_sums: ``[M]`` detached CE sums (nats), already all-reduced over data-parallel ranks.
            counts: ``[M]`` unmasked target counts ``N_i``, already all-reduced.

        Returns metrics: ``mean_depth``, ``entropy`` (nats), ``probs`` (list, depths 1..r_max) of the
        distribution AFTER the update; ``scale`` and ``baseline`` USED for this step's advantage;
        ``adv_mean``/``adv_abs_mean`` (token-weighted); ``per_depth_ce`` ({depth: CE}); ``step_ce``;
        ``loss`` (prior loss before the Adam step, NaN when logits did not move); ``logits_updated``
        (0/1); ``num_updates``. A step with ``Σ N_i = 0`` is skipped (choice): nothing changes,
        ``skipped`` = 1.
        """
        cfg = self.cfg
        depths = [int(r) for r in depths]
        s_tot, n_tot = as_float64(ce_sums), as_float64(counts)
        m = len(depths)
        if not (m >= 1 and s_tot.numel() == m and n_tot.numel() == m):
            raise ValueError(f"prior update needs equal, non-empty depths/ce_sums/counts, "
                             f"got {m}/{s_tot.numel()}/{n_tot.numel()}")
        for r in depths:
            if not (1 <= r <= cfg.r_max and bool(self.active[r - 1])):
                raise ValueError(f"prior update: depth {r} is outside the prior's active support")
        if not bool((n_tot >= 0).all()) or not bool(torch.isfinite(s_tot).all()):
            raise ValueError("prior update: counts must be >= 0 and CE sums finite")
        total = float(n_tot.sum())
        if total <= 0:
            return {**self._dist_metrics(), "skipped": 1, "num_updates": self.num_updates}

        ce = s_tot / n_tot.clamp_min(1.0)  # ℓ_i (a zero-count microbatch has weight 0 anyway)
        w = n_tot / total
        u = _reward(ce, cfg.reward)
        step = {"mu_ce": float((w * ce).sum()), "m_ce": float((w * ce * ce).sum()),
                "mu_u": float((w * u).sum()), "m_u": float((w * u * u).sum())}

        self.num_updates += 1
        first = self.num_updates == 1
        loss_val = float("nan")
        moved = False
        if first:
            # No baseline exists before step 1: it only initialises the statistics (s = 1).
            self.stats = dict(step)
            scale, base = 1.0, self.baseline
            adv = torch.zeros(m, dtype=torch.float64)
        else:
            scale, base = self.scale, self.baseline
            adv = -(ce - base) if cfg.reward == "raw_ce" else scale * (u - base)
            if self.num_updates > cfg.warmup_updates and not cfg.frozen:
                self.optimizer.zero_grad(set_to_none=True)
                loss = self.loss(depths, adv, w)
                loss.backward()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                loss_val, moved = float(loss.detach()), True
                self.num_logit_steps += 1
            nu = cfg.ema_decay
            self.stats = {k: nu * self.stats[k] + (1.0 - nu) * step[k] for k in _STAT_KEYS}

        return {
            **self._dist_metrics(),
            "scale": scale,
            "baseline": base,
            "adv_mean": float((w * adv).sum()),
            "adv_abs_mean": float((w * adv.abs()).sum()),
            "step_ce": step["mu_ce"],
            "per_depth_ce": per_depth_ce(depths, s_tot, n_tot),
            "loss": loss_val,
            "logits_updated": int(moved),
            "num_updates": self.num_updates,
            "skipped": 0,
        }

    def _dist_metrics(self) -> dict[str, Any]:
        p = self.probs()
        return {"mean_depth": categorical_mean(p), "entropy": categorical_entropy(p), "probs": p.tolist()}

    # ---- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Deep-copied state: restoring it continues bitwise identically."""
        return {
            "r_max": self.cfg.r_max,
            "init": self.cfg.init,
            "reward": self.cfg.reward,
            "active": self.active.clone(),
            "logits": self.logits.detach().clone(),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "stats": dict(self.stats),
            "num_updates": self.num_updates,
            "num_logit_steps": self.num_logit_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        require(int(state["r_max"]) == self.cfg.r_max, "depth.r_max",
                f"checkpoint prior has r_max={state['r_max']}, config has {self.cfg.r_max}")
        # (choice) init/reward may differ (e.g. resuming with another arm is allowed), support may not.
        active = torch.as_tensor(state["active"], dtype=torch.bool)
        if self.cfg.init_from is not None:  # the support came from the other run; the checkpoint has it
            self.active = active.clone()
            self._active_idx = torch.nonzero(self.active).flatten()
        require(bool(torch.equal(active, self.active)), "depth.init",
                f"checkpoint prior's active support differs from init={self.cfg.init!r}")
        with torch.no_grad():
            self.logits.copy_(torch.as_tensor(state["logits"], dtype=torch.float64))
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        for group in self.optimizer.param_groups:  # (choice) hyper-parameters come from the config
            group.update(lr=self.cfg.lr, betas=(self.cfg.beta1, self.cfg.beta2), weight_decay=0.0)
        self.stats = {k: float(state["stats"][k]) for k in _STAT_KEYS}
        self.num_updates = int(state["num_updates"])
        self.num_logit_steps = int(state.get("num_logit_steps", 0))
