"""PLN calibration and pmf checks against independent numpy quadrature and Monte Carlo (SPEC §4)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megaloop.depth.distributions import fixed, pln, pln_expected_depth, pln_mu, pln_probs


def _ref_poisson_cdf_terms(mu: float, sigma: float, cap: int, nodes: int = 300) -> tuple[np.ndarray, np.ndarray]:
    """Gauss–Hermite nodes' weights and Poisson CDFs F(j; e^τ), j = 0..cap-2 (independent of the package)."""
    x, w = np.polynomial.hermite.hermgauss(nodes)
    w = w / np.sqrt(np.pi)
    lam = np.exp(mu + sigma * np.sqrt(2.0) * x)
    k = np.arange(cap - 1)
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, cap - 1)))])
    pmf = np.exp(k[None, :] * np.log(lam)[:, None] - lam[:, None] - log_fact[None, :])
    return w, np.cumsum(pmf, axis=1)


def _ref_capped_mean(mu: float, sigma: float, cap: int) -> float:
    """E[min(R, cap)] = 1 + Σ_{j=0}^{cap-2} P(Poisson > j), averaged over τ."""
    w, cdf = _ref_poisson_cdf_terms(mu, sigma, cap)
    return 1.0 + float((w[:, None] * (1.0 - cdf)).sum())


@pytest.mark.parametrize("mean,sigma,cap", [(5.0, 0.5, 64), (3.0, 1.0, 16), (20.0, 0.5, 24), (2.5, 0.5, 4), (40.0, 0.5, 64)])
def test_solved_mu_gives_exact_capped_mean(mean: float, sigma: float, cap: int) -> None:
    mu = pln_mu(mean, sigma, cap)
    assert abs(_ref_capped_mean(mu, sigma, cap) - mean) < 1e-9
    assert abs(pln_expected_depth(mean, sigma, cap) - mean) < 1e-9


def test_pln_probs_match_reference_pmf_and_tail() -> None:
    mean, sigma, cap = 5.0, 0.5, 64
    p = pln_probs(mean, sigma, cap).numpy()
    w, cdf = _ref_poisson_cdf_terms(pln_mu(mean, sigma, cap), sigma, cap)
    pmf = np.diff(np.concatenate([np.zeros((len(w), 1)), cdf], axis=1), axis=1)
    ref_head = (w[:, None] * pmf).sum(0)
    ref_tail = float((w * (1.0 - cdf[:, -1])).sum())  # P(Poisson >= cap-1) = P(R >= cap)
    assert p.shape == (cap,) and (p > 0).all() and abs(p.sum() - 1.0) < 1e-12
    np.testing.assert_allclose(p[:-1], ref_head, rtol=1e-6, atol=1e-13)
    assert p[-1] == pytest.approx(ref_tail, rel=1e-5)  # tail mass accumulated at the cap


def test_pln5_sampled_mean_monte_carlo() -> None:
    """Direct simulation of τ ~ N(μ,σ²), R = Poisson(e^τ)+1, min(R,64): mean 5 ± 0.05, pmf agrees."""
    mu = pln_mu(5.0, 0.5, 64)
    g = torch.Generator().manual_seed(0)
    n = 100_000
    tau = mu + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
    r = (torch.poisson(tau.exp(), generator=g) + 1).clamp_max(64)
    assert abs(float(r.mean()) - 5.0) < 0.05
    hist = torch.bincount(r.long(), minlength=65)[1:].double() / n
    p = pln_probs(5.0, 0.5, 64)
    se = (p * (1 - p) / n).sqrt()
    assert bool(((hist[:12] - p[:12]).abs() <= 5 * se[:12] + 1e-12).all())


def test_pln_and_fixed_objects() -> None:
    d = pln(5.0)
    assert d.max_depth == 64 and d.mean() == pytest.approx(5.0, abs=1e-12)
    g = torch.Generator().manual_seed(1)
    assert abs(float(np.mean(d.sample(100_000, g))) - 5.0) < 0.05
    f = fixed(7)
    assert f.sample(5, g) == [7] * 5 and f.mean() == 7.0 and f.entropy() == 0.0


def test_extreme_pln_masses_positive() -> None:
    for mean, sigma, cap in [(1.0001, 0.5, 64), (63.9, 0.5, 64), (5.0, 0.05, 64), (1.5, 2.0, 128)]:
        p = pln_probs(mean, sigma, cap)
        assert bool((p > 0).all()) and abs(float(p.sum()) - 1) < 1e-12
        assert pln_expected_depth(mean, sigma, cap) == pytest.approx(mean, abs=1e-9)


def test_poisson_probs_equal_parcae_law_exactly() -> None:
    """``max(Poisson(λ), 1)`` capped: hand pmf from the factorial formula, tail at the cap."""
    from megaloop.depth.distributions import poisson, poisson_probs

    lam, cap = 5.0, 12
    p = poisson_probs(lam, cap)
    q = [math.exp(-lam) * lam**n / math.factorial(n) for n in range(cap)]
    assert p.shape == (cap,) and abs(float(p.sum()) - 1.0) < 1e-12
    assert abs(float(p[0]) - (q[0] + q[1])) < 1e-15  # N = 0 is clamped to depth 1
    for d in range(2, cap):
        assert abs(float(p[d - 1]) - q[d]) < 1e-15
    assert abs(float(p[-1]) - (1.0 - sum(q))) < 1e-12  # P(N >= cap)
    mean = poisson(lam, 64).mean()
    assert abs(mean - (lam + math.exp(-lam))) < 1e-9  # E[max(N, 1)] = λ + e^-λ, cap 64 far out


def test_poisson_sampler_monte_carlo_matches_torch_poisson() -> None:
    """The sampler's draws follow the law Parcae's trainer draws with torch.poisson + clamp."""
    from megaloop.depth import DepthConfig, DepthSampler

    s = DepthSampler(DepthConfig(kind="poisson", mean=5.0), seed=3)
    draws = np.array([d for step in range(1, 2001) for d in s.plan(step, 50)])
    ref = torch.poisson(torch.full((100_000,), 5.0), generator=torch.Generator().manual_seed(0)).clamp(min=1)
    assert abs(draws.mean() - float(ref.mean())) < 0.05
    for d in (1, 2, 5, 10):
        assert abs((draws == d).mean() - float((ref == d).double().mean())) < 0.006


@pytest.mark.parametrize("field,kw", [("depth.mean", {"mean": 0.0}), ("depth.cap", {"cap": 1})])
def test_poisson_config_errors_name_field(field: str, kw: dict) -> None:
    from megaloop.config_utils import ConfigError
    from megaloop.depth import DepthConfig

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        DepthConfig(kind="poisson", **kw)
