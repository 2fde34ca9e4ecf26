"""Learned prior vs an independent float64 numpy reference of SPEC §5 (analytic gradient, own Adam)."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from megaloop.depth.config import DepthConfig
from megaloop.depth.distributions import pln_probs
from megaloop.depth.prior import LearnedDepthPrior


class RefPrior:
    """Plain-numpy restatement of SPEC §5 (no torch, no code shared with the package)."""

    def __init__(self, logits: np.ndarray, active: np.ndarray, cfg: DepthConfig) -> None:
        self.phi, self.active, self.cfg = logits.astype(np.float64).copy(), active.copy(), cfg
        self.m = np.zeros_like(self.phi)
        self.v = np.zeros_like(self.phi)
        self.t = 0  # Adam steps
        self.n = 0  # updates
        self.mu_l = self.m_l = self.mu_u = self.m_u = 0.0
        self.last_scale = self.last_baseline = float("nan")

    def omega(self, ell: np.ndarray) -> np.ndarray:
        arm = self.cfg.reward
        if arm == "exp":
            return np.exp(-ell)
        if arm == "neglog":
            return -np.log(np.maximum(ell, 1e-12))
        if arm == "negexp":
            return -np.exp(ell)
        return -ell

    def probs(self) -> np.ndarray:
        p = np.zeros_like(self.phi)
        z = self.phi[self.active]
        e = np.exp(z - z.max())
        p[self.active] = e / e.sum()
        return p

    def grad(self, depths: list[int], adv: np.ndarray, w: np.ndarray) -> np.ndarray:
        c = self.cfg
        p = self.probs()
        r = np.arange(1, len(p) + 1, dtype=np.float64)
        act = self.active
        logp = np.zeros_like(p)
        logp[act] = np.log(p[act])
        h = -(p[act] * logp[act]).sum()
        mean = (p * r).sum()
        g = np.zeros_like(p)
        for d, a, wi in zip(depths, adv, w):  # -Ê[A ∂log p(r_i)], ∂log p(r_i)/∂φ = e_{r_i} - p
            onehot = np.zeros_like(p)
            onehot[d - 1] = 1.0
            g -= wi * a * (onehot - p)
        dh = -p * (logp + h)  # ∂H/∂φ(r) = -p(r)[log p(r) + H]
        g -= c.entropy_coef * dh
        g += c.mean_coef * 2.0 * (mean - c.target_mean) * p * (r - mean)
        g[~act] = 0.0
        return g

    def update(self, depths: list[int], sums: np.ndarray, counts: np.ndarray) -> None:
        c = self.cfg
        ell = sums / counts
        w = counts / counts.sum()
        u = self.omega(ell)
        e = {"l": (w * ell).sum(), "l2": (w * ell**2).sum(), "u": (w * u).sum(), "u2": (w * u**2).sum()}
        self.n += 1
        if self.n == 1:
            self.mu_l, self.m_l, self.mu_u, self.m_u = e["l"], e["l2"], e["u"], e["u2"]
            self.last_scale, self.last_baseline = 1.0, (self.mu_l if c.reward == "raw_ce" else self.mu_u)
            return
        sd = lambda mu, m: max(math.sqrt(max(m - mu * mu, 0.0)), 1e-12)  # noqa: E731
        if c.reward == "raw_ce":
            s, base = 1.0, self.mu_l
            adv = -(ell - base)
        else:
            s, base = sd(self.mu_l, self.m_l) / sd(self.mu_u, self.m_u), self.mu_u
            adv = s * (u - base)
        self.last_scale, self.last_baseline = s, base
        if self.n > c.warmup_updates and not c.frozen:
            g = self.grad(depths, adv, w)
            self.t += 1
            self.m = c.beta1 * self.m + (1 - c.beta1) * g
            self.v = c.beta2 * self.v + (1 - c.beta2) * g * g
            mhat = self.m / (1 - c.beta1**self.t)
            vhat = self.v / (1 - c.beta2**self.t)
            self.phi = self.phi - c.lr * mhat / (np.sqrt(vhat) + 1e-8)
        nu = c.ema_decay
        self.mu_l = nu * self.mu_l + (1 - nu) * e["l"]
        self.m_l = nu * self.m_l + (1 - nu) * e["l2"]
        self.mu_u = nu * self.mu_u + (1 - nu) * e["u"]
        self.m_u = nu * self.m_u + (1 - nu) * e["u2"]


def stream(n: int, active_max: int, seed: int = 1234) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
    """Fixed pseudo-random (depths, CE sums, counts) per step; 1-6 microbatches, CE falls with depth."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        m = int(rng.integers(1, 7))
        depths = [int(d) for d in rng.integers(1, active_max + 1, size=m)]
        counts = rng.integers(50, 2000, size=m).astype(np.float64)
        ell = np.array([2.2 + 1.5 / d + 0.3 * rng.standard_normal() for d in depths])
        out.append((depths, ell * counts, counts))
    return out


def _init_logits(cfg: DepthConfig) -> tuple[np.ndarray, np.ndarray]:
    active = np.ones(cfg.r_max, dtype=bool)
    if cfg.init == "pln":
        return np.log(pln_probs(cfg.mean, cfg.sigma, cfg.r_max).numpy()), active
    if cfg.init == "uniform_1_10":
        active[10:] = False
    return np.zeros(cfg.r_max), active


def _run_against_reference(cfg: DepthConfig, n: int = 50, lr_scale: float = 1.0) -> LearnedDepthPrior:
    prior = LearnedDepthPrior(cfg)
    logits, active = _init_logits(cfg)
    ref = RefPrior(logits, active, cfg)
    np.testing.assert_allclose(prior.logits.detach().numpy(), logits, atol=1e-12)
    for depths, sums, counts in stream(n, 10 if cfg.init == "uniform_1_10" else 16):
        met = prior.update(depths, torch.from_numpy(sums), torch.from_numpy(counts))
        ref.update(depths, sums, counts)
        np.testing.assert_allclose(prior.logits.detach().numpy()[active], ref.phi[active], rtol=0, atol=1e-6)
        assert met["baseline"] == pytest.approx(ref.last_baseline, abs=1e-6)
        assert met["scale"] == pytest.approx(ref.last_scale, rel=1e-6, abs=1e-6)
        assert prior.stats["mu_ce"] == pytest.approx(ref.mu_l, abs=1e-9)
        assert prior.stats["m_u"] == pytest.approx(ref.m_u, abs=1e-9)
        np.testing.assert_allclose(met["probs"], ref.probs(), atol=1e-9)
    return prior


@pytest.mark.parametrize("reward", ["exp", "neglog", "negexp", "raw_ce"])
@pytest.mark.parametrize("warmup", [32, 5])
def test_matches_reference_every_arm(reward: str, warmup: int) -> None:
    cfg = DepthConfig(kind="learned", reward=reward, warmup_updates=warmup, lr=2e-2)
    prior = _run_against_reference(cfg)
    assert prior.num_logit_steps == 50 - max(warmup, 1)
    assert not torch.allclose(prior.logits.detach(), pln_probs(5.0, 0.5, 64).log())  # logits did move


@pytest.mark.parametrize("init", ["uniform", "uniform_1_10"])
def test_matches_reference_uniform_inits(init: str) -> None:
    cfg = DepthConfig(kind="learned", init=init, reward="raw_ce", warmup_updates=3, lr=5e-2, entropy_coef=0.05)
    prior = _run_against_reference(cfg, n=30)
    if init == "uniform_1_10":
        assert bool((prior.probs()[10:] == 0).all())
        assert bool(torch.equal(prior.logits.detach()[10:], torch.zeros(54, dtype=torch.float64)))


def test_default_lr_matches_reference() -> None:
    _run_against_reference(DepthConfig(kind="learned", warmup_updates=5), n=40)


def test_warmup_leaves_logits_but_moves_stats() -> None:
    cfg = DepthConfig(kind="learned", lr=1e-1)  # warmup_updates = 32
    prior = LearnedDepthPrior(cfg)
    phi0 = prior.logits.detach().clone()
    data = stream(40, 16)
    baselines = []
    for i, (d, s, c) in enumerate(data[:32]):
        met = prior.update(d, s, c)
        assert met["logits_updated"] == 0
        baselines.append(prior.baseline)
    assert torch.equal(prior.logits.detach(), phi0)
    assert len(set(baselines)) > 1 and prior.scale != 1.0 and prior.num_updates == 32
    met = prior.update(*data[32])
    assert met["logits_updated"] == 1 and not torch.equal(prior.logits.detach(), phi0)


def test_first_update_only_initialises() -> None:
    prior = LearnedDepthPrior(DepthConfig(kind="learned", warmup_updates=0, lr=1e-1))
    phi0 = prior.logits.detach().clone()
    met = prior.update([3, 7], [2.0 * 100, 3.0 * 300], [100, 300])
    assert torch.equal(prior.logits.detach(), phi0) and met["scale"] == 1.0 and met["adv_abs_mean"] == 0.0
    assert prior.stats["mu_ce"] == pytest.approx((200 + 900) / 400)  # token-weighted
    assert met["per_depth_ce"] == {3: pytest.approx(2.0), 7: pytest.approx(3.0)}
    assert prior.update([3], [250.0], [100])["logits_updated"] == 1


def test_frozen_never_moves_logits() -> None:
    prior = LearnedDepthPrior(DepthConfig(kind="learned", frozen=True, warmup_updates=0, lr=1e-1))
    phi0 = prior.logits.detach().clone()
    for d, s, c in stream(50, 16):
        prior.update(d, s, c)
    assert torch.equal(prior.logits.detach(), phi0) and prior.num_updates == 50 and prior.baseline != 0.0


def test_entropy_gradient_autograd_vs_analytic() -> None:
    g = torch.Generator().manual_seed(0)
    phi = torch.randn(64, generator=g, dtype=torch.float64, requires_grad=True)
    logp = torch.log_softmax(phi, 0)
    p = logp.exp()
    h = -(p * logp).sum()
    (-h).backward()
    with torch.no_grad():
        analytic_dh = -p * (logp + h)  # ∂H/∂φ(r) = -p(r)[log p(r) + H]
    torch.testing.assert_close(phi.grad, -analytic_dh, rtol=0, atol=1e-13)


def test_full_loss_gradient_autograd_vs_reference() -> None:
    cfg = DepthConfig(kind="learned", init="uniform_1_10", entropy_coef=0.3, mean_coef=0.7)
    prior = LearnedDepthPrior(cfg)
    with torch.no_grad():
        prior.logits.copy_(torch.randn(64, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    logits, active = prior.logits.detach().numpy().copy(), prior.active.numpy()
    depths, adv, w = [1, 4, 4, 9], np.array([0.3, -1.2, 0.5, 2.0]), np.array([0.1, 0.2, 0.3, 0.4])
    prior.loss(depths, torch.from_numpy(adv), torch.from_numpy(w)).backward()
    ref = RefPrior(logits, active, cfg).grad(depths, adv, w)
    np.testing.assert_allclose(prior.logits.grad.numpy(), ref, atol=1e-12)


def test_state_dict_round_trip_is_bitwise() -> None:
    cfg = DepthConfig(kind="learned", warmup_updates=5, lr=3e-2)
    a = LearnedDepthPrior(cfg)
    data = stream(40, 16, seed=7)
    for d, s, c in data[:20]:
        a.update(d, s, c)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = LearnedDepthPrior(DepthConfig(kind="learned", warmup_updates=5, lr=3e-2))
    b.load_state_dict(torch.load(buf, weights_only=False))
    for d, s, c in data[20:]:
        ma, mb = a.update(d, s, c), b.update(d, s, c)
        assert torch.equal(a.logits.detach(), b.logits.detach())
        assert ma == mb


def test_state_dict_is_a_snapshot() -> None:
    prior = LearnedDepthPrior(DepthConfig(kind="learned", warmup_updates=1, lr=1e-1))
    for d, s, c in stream(5, 16):
        prior.update(d, s, c)
    sd = prior.state_dict()
    saved = sd["optimizer"]["state"][0]["exp_avg"].clone()
    for d, s, c in stream(5, 16, seed=3):
        prior.update(d, s, c)
    assert torch.equal(sd["optimizer"]["state"][0]["exp_avg"], saved)


def test_bad_inputs_rejected_and_empty_step_skipped() -> None:
    prior = LearnedDepthPrior(DepthConfig(kind="learned", init="uniform_1_10"))
    with pytest.raises(ValueError, match="depth 11"):
        prior.update([11], [1.0], [1.0])
    with pytest.raises(ValueError, match="equal"):
        prior.update([1, 2], [1.0], [1.0])
    assert prior.update([1], [0.0], [0])["skipped"] == 1 and prior.num_updates == 0
