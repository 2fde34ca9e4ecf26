"""megaloop.train.metrics.prior_metrics: what metrics.jsonl records of the depth prior."""

from __future__ import annotations

import json

import numpy as np

from megaloop.train.metrics import prior_metrics


class _Sampler:
    def __init__(self, probs):
        self._p = np.asarray(probs, dtype=np.float64)

    def probs(self):
        return self._p

    def mean_depth(self) -> float:
        return float((self._p * np.arange(1, len(self._p) + 1)).sum())

    def entropy(self) -> float:
        return float(-(self._p * np.log(self._p)).sum())


def test_tail_masses_keep_six_significant_digits():
    """prior_probs were rounded to 6 decimals: at r_max 64 a tail mass below 5e-7 showed as 0 and its
    moves were invisible to plot_prior.py --log."""
    p = np.full(64, 1.234567891e-7)
    p[0] = 1.0 - p[1:].sum()
    out = json.loads(json.dumps(prior_metrics(_Sampler(p), {})))
    assert out["prior_probs"][-1] == 1.23457e-07 and out["prior_probs"][0] == float(f"{p[0]:.6g}")
    assert abs(sum(out["prior_probs"]) - 1.0) < 1e-5
