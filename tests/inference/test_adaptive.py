"""Adaptive per-token depth (megaloop.inference.adaptive / megaloop.hf.adaptive_megaloop): ε = 0 is
fixed depth bit for bit, a huge ε stops at min_depth, batch rows with different exit depths equal
each row alone (masking and compaction, both caches), per-visit banks of a stopped token, compute
accounting, teacher-forced scoring, bad options. Pure-PyTorch models (no megatron, no checkpoint)."""

from __future__ import annotations

import pytest
import torch

from megaloop.config_utils import ConfigError
from megaloop.inference.adaptive import DepthLog, exit_policy
from megaloop.inference.engine import InferenceEngine
from tests.inference.helpers import CharTokenizer, make_engine, make_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PROMPTS = ["hello wor", "ab", "looped models"]
MODES = ("terminal", "per_visit")
ROWS = ("mask", "compact")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("crit", ["latent:0", "kl:0", "argmax:99"])
def test_never_exiting_equals_fixed_depth_exactly(mode, crit):
    eng = make_engine(depth=3, seed=4)
    kw = dict(max_new_tokens=6, cache_mode=mode, return_logits=True, stop_at_eos=False)
    fixed = eng.generate(PROMPTS, decode_depth=7, **kw)
    for rows in ROWS:
        ada = eng.generate(PROMPTS, exit_criterion=crit, max_depth=7, finished_rows=rows, **kw)
        for f, a in zip(fixed.results, ada.results):
            assert a.token_ids == f.token_ids and torch.equal(a.logits, f.logits), (crit, rows)
            assert a.depths == [7] * (len(a.token_ids) - 1)
        assert ada.stats.mean_depth == 7 and ada.stats.decode_depth == 7 and ada.stats.exit_criterion == crit


@pytest.mark.parametrize("crit", ["latent:1e9", "kl:1e9"])
def test_huge_threshold_stops_every_token_at_min_depth(crit):
    eng = make_engine(depth=3, seed=4)
    for rows in ROWS:
        out = eng.generate(PROMPTS, exit_criterion=crit, min_depth=3, max_depth=9, finished_rows=rows,
                           max_new_tokens=5, stop_at_eos=False)
        assert all(r.depths == [3] * 4 for r in out.results)
        assert out.stats.depth_histogram == {3: 12} and out.stats.row_recurrences == 12 * 3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", ROWS)
def test_batch_rows_with_different_depths_equal_each_row_alone(mode, rows):
    eng = make_engine(depth=3, seed=5)
    kw = dict(exit_criterion="kl:1e-3", max_depth=12, finished_rows=rows, cache_mode=mode, max_new_tokens=6,
              stop_at_eos=False, return_logits=True)
    batch = eng.generate(PROMPTS, **kw)
    step_depths = {tuple(r.depths[j] for r in batch.results) for j in range(5)}
    assert any(len(set(d)) > 1 for d in step_depths), "rows should exit at different depths in this test"
    for p, r in zip(PROMPTS, batch.results):
        one = eng.generate(p, **kw).results[0]
        assert r.token_ids == one.token_ids and r.depths == one.depths
        assert (r.logits - one.logits).abs().max() < 1e-4


def test_compaction_computes_only_active_rows_and_masking_all():
    eng = make_engine(depth=3, seed=0)
    for rows in ROWS:
        st = eng.prefill(PROMPTS, cache_mode="terminal")
        pol = eng.policy("argmax:3", max_depth=12, finished_rows=rows)
        eng.depth_log.reset()
        eng.decode(st, torch.tensor([3, 4, 5]), policy=pol)
        d = st.last_depths.tolist()
        assert len(set(d)) > 1, d
        expect = sum(d) if rows == "compact" else 3 * max(d)
        assert eng.depth_log.row_recurrences == expect and eng.depth_log.tokens == 3


def test_per_visit_missing_deeper_banks_are_the_last_bank():
    eng = make_engine(depth=3, seed=0)
    st = eng.prefill(PROMPTS, cache_mode="per_visit", depth=3)
    eng.decode(st, torch.tensor([3, 4, 5]), policy=eng.policy("argmax:3", max_depth=12))
    depths = st.last_depths.tolist()
    cache = st.cache
    assert cache.visits == max(depths) and len(set(depths)) > 1
    for row, d in enumerate(depths):
        for i in range(2):
            last = cache.banks[("core", i, d - 1)].view()
            for v in range(d, cache.visits):  # the new token's deeper visits repeat its exit visit
                assert all(torch.equal(a[row, :, -1], b[row, :, -1]) for a, b in zip(cache.banks[("core", i, v)].view(), last))
            if d > 1:  # ... while shallower visits are its own
                prev = cache.banks[("core", i, d - 2)].view()[0][row, :, -1]
                assert not torch.equal(prev, last[0][row, :, -1])


def test_adaptive_scoring_per_visit_at_full_depth_is_the_parallel_forward():
    eng = make_engine(depth=4, seed=1)
    ids = torch.randint(2, 32, (2, 10), generator=torch.Generator().manual_seed(3))
    full = eng.forward(ids, depth=4)
    pol = eng.policy("latent:0", max_depth=4)
    eng.depth_log.reset()
    last, chunk = eng.score_with_prefix(ids[:, :6], ids[:, 6:], prefill_depth=4, cache_mode="per_visit", policy=pol)
    assert (last - full[:, 5]).abs().max() < 1e-5 and (chunk - full[:, 6:]).abs().max() < 1e-5
    assert eng.depth_log.histogram == {4: 8}
    # an engine-level policy applies to scoring by default; stopping early changes the logits
    early = InferenceEngine(make_model(seed=1), CharTokenizer(), depth=4, exit_criterion="latent:1e9", max_depth=4)
    _, chunk_e = early.score_with_prefix(ids[:, :6], ids[:, 6:], prefill_depth=4, cache_mode="per_visit")
    assert early.depth_log.histogram == {2: 8} and (chunk_e - full[:, 6:]).abs().max() > 1e-4


def test_depth_log_and_bad_options():
    log = DepthLog()
    log.add(torch.tensor([2, 3, 3]), 9)
    assert log.mean == pytest.approx(8 / 3) and log.histogram == {2: 1, 3: 2}
    assert log.to_dict()["compute_over_useful"] == pytest.approx(9 / 8)
    assert log.summary() == "mean depth 2.67 over 3 tokens; depth:tokens 2:1 3:2"
    assert exit_policy(None) is None and exit_policy("none") is None
    pol = exit_policy("latent:1e-3", max_depth=32)
    assert (pol.criterion, pol.threshold, pol.min_depth, pol.max_depth, pol.compaction) == ("latent", 1e-3, 2, 32, False)
    for spec, kw, msg in [("latent", {}, "--exit: exit_criterion: expected NAME:VALUE"),
                          ("depth:1", {}, "--exit: exit_criterion: unknown criterion 'depth'"),
                          ("kl:abc", {}, "--exit: exit_criterion: 'abc' is not a number"),
                          ("kl:-1", {}, "--exit: exit_criterion: threshold must be >= 0"),
                          ("argmax:1", {}, "--exit: exit_criterion: argmax needs an integer run length k >= 2"),
                          ("latent:1e-3", {"min_depth": 1}, "--min-depth: must be an integer >= 2"),
                          ("latent:1e-3", {"min_depth": 5, "max_depth": 4}, "--max-depth: must be an integer >= min_depth"),
                          ("latent:1e-3", {"finished_rows": "drop"}, "--finished-rows: one of")]:
        with pytest.raises(ConfigError, match=msg):
            exit_policy(spec, **kw)
    with pytest.raises(ConfigError, match="--exit"):
        InferenceEngine(make_model(), exit_criterion="entropy:1")
