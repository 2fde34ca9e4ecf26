"""Training-depth distributions (SPEC §4): ``fixed(R)``, the capped Poisson-lognormal ``pln``, and
``poisson`` (Parcae's trainer's law, for reference-matched runs; not a paper arm).

PLN: ``τ ~ N(μ, σ²)``, ``R = Poisson(e^τ) + 1``, ``R ← min(R, cap)``. ``μ`` is solved numerically so
that ``E[min(R, cap)]`` equals the requested mean exactly (to ~1e-12), and :func:`pln_probs` gives the
exact capped pmf over depths ``1..cap`` (tail mass ``P(R >= cap)`` accumulated at ``cap``). Sampling
draws from this pmf (:class:`megaloop.depth.sampler.DepthSampler`), which is the same law as drawing
``τ`` and the Poisson variate directly, and the learned prior's ``pln`` init is ``log`` of it.

All numerics are float64 and pure torch (no scipy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from megaloop.config_utils import require

__all__ = [
    "DepthDistribution", "categorical_entropy", "categorical_mean", "fixed", "fixed_probs", "pln",
    "pln_expected_depth", "pln_mu", "pln_probs", "poisson", "poisson_probs", "sample_categorical",
]

# Quadrature over the latent normal: trapezoid rule on a uniform grid of z = (τ-μ)/σ in [-Z, Z].
# (choice) The trapezoid rule on R is exponentially convergent for this analytic, Gaussian-decaying
# integrand; unlike a fixed Gauss–Hermite rule its spacing adapts to the narrowest feature (a Poisson
# pmf of depth ~cap has width ~1/(σ√cap) in z), so accuracy does not degrade for large σ or cap.
_Z_MAX = 10.0


def _z_grid(sigma: float, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes ``z`` and weights ``w`` (sum 1) approximating ``E_{z~N(0,1)}[f(z)]``."""
    h = min(0.05, 1.0 / (6.0 * max(1.0, sigma * math.sqrt(cap))))  # 4.0 already agrees to 1e-12
    n = int(math.ceil(_Z_MAX / h))
    z = torch.arange(-n, n + 1, dtype=torch.float64) * h
    w = torch.exp(-0.5 * z * z)
    return z, w / w.sum()


def _pln_pmf(mu: float, sigma: float, cap: int) -> torch.Tensor:
    """Capped PLN pmf over depths ``1..cap`` (float64 ``[cap]``) for latent mean ``mu``."""
    if cap == 1:
        return torch.ones(1, dtype=torch.float64)
    z, w = _z_grid(sigma, cap)
    log_lam = mu + sigma * z  # [G]
    lam = torch.exp(log_lam)
    j = torch.arange(cap - 1, dtype=torch.float64)  # Poisson values 0..cap-2 -> depths 1..cap-1
    log_pmf = j[None, :] * log_lam[:, None] - lam[:, None] - torch.lgamma(j + 1.0)[None, :]  # [G, cap-1]
    pmf = torch.exp(log_pmf)
    head = (w[:, None] * pmf).sum(0)
    # Tail P(Poisson(λ) >= n), n = cap-1, per node. For λ < n sum the upper series directly (terms
    # shrink at least like exp(-m²/2n) after m steps, so 9√n + 20 terms reach 1e-18 relative): no
    # 1-cdf cancellation, so tiny tails stay accurate and > 0. For λ >= n the head holds at most
    # ~1/2 of the mass and 1 - head is accurate. (torch.special.gammainc is only ~1e-10 accurate.)
    n = cap - 1
    ju = torch.arange(n, n + int(math.ceil(9.0 * math.sqrt(n))) + 20, dtype=torch.float64)
    upper = torch.exp(ju[None, :] * log_lam[:, None] - lam[:, None] - torch.lgamma(ju + 1.0)[None, :]).sum(1)
    tail_node = torch.where(lam < n, upper, (1.0 - pmf.sum(1)).clamp_min(0.0))
    tail = (w * tail_node).sum()
    return torch.cat([head, tail.reshape(1)])


def _capped_mean(mu: float, sigma: float, cap: int) -> float:
    """``E[min(R, cap)]`` for latent mean ``mu``; increasing in ``mu``."""
    p = _pln_pmf(mu, sigma, cap)
    return float((p * torch.arange(1, cap + 1, dtype=torch.float64)).sum())


def _check(mean: float, sigma: float, cap: int) -> None:
    require(int(cap) == cap and cap >= 2, "depth.cap", f"PLN needs an integer cap >= 2, got {cap}")
    require(sigma > 0, "depth.sigma", f"must be > 0, got {sigma}")
    require(1.0 < mean < cap, "depth.mean", f"PLN mean must lie in (1, cap={cap}), got {mean}")


@lru_cache(maxsize=64)
def pln_mu(mean: float, sigma: float = 0.5, cap: int = 64) -> float:
    """Latent mean ``μ`` with ``E[min(Poisson(e^τ)+1, cap)] = mean`` for ``τ ~ N(μ, σ²)``.

    The capped mean is increasing in ``μ``. Bracket around the uncapped solution
    ``μ₀ = log(mean-1) - σ²/2`` (capping only lowers the mean, so ``μ₀ - 1`` is below the root), then
    Illinois regula falsi (superlinear, bracket kept) to |error| <= 1e-13·mean.
    """
    _check(mean, sigma, cap)

    def f(mu: float) -> float:
        return _capped_mean(mu, sigma, cap) - mean

    lo = math.log(mean - 1.0) - 0.5 * sigma * sigma - 1.0
    f_lo = f(lo)
    hi, f_hi = lo + 2.0, f(lo + 2.0)
    while f_hi <= 0.0:  # capping raised the required μ: walk the upper end out
        lo, f_lo = hi, f_hi
        hi, f_hi = hi + 2.0, f(hi + 2.0)
        require(hi < 100.0, "depth.mean", f"cannot bracket PLN mean {mean} (cap={cap}, sigma={sigma})")
    require(f_lo < 0.0, "depth.mean", f"cannot bracket PLN mean {mean} (cap={cap}, sigma={sigma})")
    side = 0
    c = lo
    for _ in range(200):
        c = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        if not lo < c < hi:
            c = 0.5 * (lo + hi)
        f_c = f(c)
        if abs(f_c) <= 1e-13 * mean or hi - lo <= 4e-16 * max(1.0, abs(c)):
            break
        if f_c > 0.0:
            hi, f_hi = c, f_c
            if side == -1:
                f_lo *= 0.5
            side = -1
        else:
            lo, f_lo = c, f_c
            if side == 1:
                f_hi *= 0.5
            side = 1
    return c


@lru_cache(maxsize=64)
def _pln_probs_cached(mean: float, sigma: float, cap: int) -> torch.Tensor:
    p = _pln_pmf(pln_mu(mean, sigma, cap), sigma, cap)
    p = p.clamp_min(torch.finfo(torch.float64).tiny)  # guarantee every mass > 0 (underflow guard)
    return p / p.sum()


def pln_probs(mean: float, sigma: float = 0.5, cap: int = 64) -> torch.Tensor:
    """Capped PLN probabilities of depths ``1..cap``: float64 tensor ``[cap]``, all > 0, sums to 1.

    Index ``k`` holds ``P(min(R, cap) = k+1)``; the last entry holds the tail ``P(R >= cap)``.
    """
    return _pln_probs_cached(float(mean), float(sigma), int(cap)).clone()


def pln_expected_depth(mean: float, sigma: float = 0.5, cap: int = 64) -> float:
    """``E[min(R, cap)]`` under the solved ``μ`` (equals ``mean`` to ~1e-12)."""
    return categorical_mean(pln_probs(mean, sigma, cap))


def fixed_probs(depth: int) -> torch.Tensor:
    """Point mass at ``depth`` as a float64 vector over depths ``1..depth``."""
    require(int(depth) == depth and depth >= 1, "depth.depth", f"must be an integer >= 1, got {depth}")
    p = torch.zeros(int(depth), dtype=torch.float64)
    p[-1] = 1.0
    return p


def categorical_mean(probs: torch.Tensor) -> float:
    """Mean depth ``Σ_r r p(r)`` of a pmf over depths ``1..len(probs)``."""
    r = torch.arange(1, probs.numel() + 1, dtype=torch.float64)
    return float((probs.double() * r).sum())


def categorical_entropy(probs: torch.Tensor) -> float:
    """Shannon entropy in nats, ``0 log 0 = 0``."""
    p = probs.double()
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def sample_categorical(probs: torch.Tensor, n: int, generator: torch.Generator) -> list[int]:
    """``n`` i.i.d. depths (1-based) from ``probs`` by inverse CDF on float64 uniforms.

    Deterministic given the generator state and ``probs``; depths with zero mass are never drawn.
    """
    p = probs.detach().double().cpu()
    cdf = torch.cumsum(p, 0)
    u = torch.rand(int(n), generator=generator, dtype=torch.float64) * cdf[-1]
    idx = torch.searchsorted(cdf, u, right=True)
    last = int(torch.nonzero(p > 0)[-1])  # guards u == cdf[-1] after rounding
    return [int(i) + 1 for i in idx.clamp_max(last)]


@dataclass(frozen=True)
class DepthDistribution:
    """A static depth law: ``probs[k] = P(depth = k+1)`` (float64 ``[max_depth]``)."""

    name: str
    probs: torch.Tensor

    @property
    def max_depth(self) -> int:
        return int(self.probs.numel())

    def mean(self) -> float:
        return categorical_mean(self.probs)

    def entropy(self) -> float:
        return categorical_entropy(self.probs)

    def sample(self, n: int, generator: torch.Generator) -> list[int]:
        return sample_categorical(self.probs, n, generator)


def fixed(depth: int) -> DepthDistribution:
    """``fixed(R)``: every microbatch runs ``R`` recurrences."""
    return DepthDistribution(f"fixed({int(depth)})", fixed_probs(depth))


def pln(mean: float, sigma: float = 0.5, cap: int = 64) -> DepthDistribution:
    """Capped PLN with ``E[min(R, cap)] = mean`` exactly (see :func:`pln_mu`)."""
    return DepthDistribution(f"pln(mean={mean:g}, sigma={sigma:g}, cap={int(cap)})", pln_probs(mean, sigma, cap))


def poisson_probs(rate: float, cap: int = 64) -> torch.Tensor:
    """``R = min(max(N, 1), cap)``, ``N ~ Poisson(rate)``: float64 pmf over depths ``1..cap``.

    Parcae's trainer draws ``clamp(Poisson(mean_recurrence), min=1)`` per sequence, so ``P(R=1) =
    P(N=0) + P(N=1)`` and ``E[R] = rate + e^{-rate}`` before the cap (5.0067 at rate 5); the tail
    ``P(N >= cap)`` sits at ``cap``. Every mass is > 0.
    """
    require(rate > 0, "depth.mean", f"poisson: the rate must be > 0, got {rate}")
    require(int(cap) == cap and cap >= 2, "depth.cap", f"poisson: must be an integer >= 2, got {cap}")
    k = torch.arange(int(cap), dtype=torch.float64)  # Poisson values 0..cap-1
    pmf = (k * math.log(rate) - rate - torch.lgamma(k + 1)).exp()
    p = torch.empty(int(cap), dtype=torch.float64)
    p[0] = pmf[0] + pmf[1]  # N in {0, 1} -> depth 1
    p[1:-1] = pmf[2:]  # N = d -> depth d, 2 <= d <= cap-1
    p[-1] = max(1.0 - float(pmf.sum()), 0.0)  # P(N >= cap) -> depth cap
    p = p.clamp_min(torch.finfo(torch.float64).tiny)
    return p / p.sum()


def poisson(rate: float, cap: int = 64) -> DepthDistribution:
    """``max(Poisson(rate), 1)`` capped at ``cap`` (:func:`poisson_probs`)."""
    return DepthDistribution(f"poisson(rate={rate:g}, min=1, cap={int(cap)})", poisson_probs(rate, cap))
