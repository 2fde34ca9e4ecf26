"""PPL protocol on a trained tiny checkpoint: sharing is not free, per-visit = parallel forward,
the engine reproduces the native model, depth sweep + plot, fixed-point report."""

from __future__ import annotations

import math

import pytest
import torch

from megaloop.config_utils import ConfigError
from megaloop.eval.ppl import evaluate_ppl, load_eval_data, sharing_penalty


def test_engine_from_checkpoint_matches_native(trained_engine, trained_run, val_data):
    from megaloop.hf.convert import load_native

    native, *_ = load_native(trained_run)
    ids = val_data.tokens[:2, :64]
    with torch.no_grad():
        ref = native(ids, depth=4).float()
    got = trained_engine.forward(ids, depth=4)
    err = (got - ref[..., :got.shape[-1]]).abs().max().item()
    assert got.shape[-1] == trained_engine.vocab_size or got.shape[-1] == ref.shape[-1]
    assert err < 1e-4, f"engine vs native logits {err:.2e}"
    assert trained_engine.source["step"] == 30 and trained_engine.tokenizer is not None


def test_sharing_is_not_free_on_a_trained_model(trained_engine, val_data):
    res = evaluate_ppl(trained_engine, val_data, depth=trained_engine.depth)
    assert res.num_seqs == 8 and res.split == 64 and res.tokens_scored == 8 * 63
    for v in (res.native_ppl, res.native_ppl_second_half, res.terminal_ppl, res.per_visit_ppl):
        assert v is not None and math.isfinite(v) and v > 1
    # the gap is reported, finite, and the two caches really give different PPLs
    assert math.isfinite(res.sharing_penalty_pct)
    assert res.terminal_ppl != res.per_visit_ppl
    assert res.sharing_penalty_pct == pytest.approx(sharing_penalty(res.terminal_ppl, res.per_visit_ppl))
    # full per-visit cache at P == R reproduces the plain parallel forward on the scored half
    assert res.per_visit_ppl == pytest.approx(res.native_ppl_second_half, rel=1e-5)
    assert res.kv_bytes_per_token["per_visit"] == res.kv_bytes_per_token["terminal"] * (2 + 2 * res.depth) // 4
    # separate prefill budget: still finite, and differs from P == R
    deep = evaluate_ppl(trained_engine, val_data, depth=trained_engine.depth, prefill_depth=8,
                        protocols=("terminal",))
    assert deep.native_ppl is None and math.isfinite(deep.terminal_ppl) and deep.terminal_ppl != res.terminal_ppl


def test_depth_sweep_table_and_plot(trained_engine, val_data, tmp_path):
    from megaloop.eval.depth_sweep import depth_sweep, parse_depths, plot_sweep

    small = load_eval_data("default", default_seq_len=trained_engine.max_context, max_seqs=2)
    res = depth_sweep(trained_engine, small, [1, 2, 8], sharing=True)
    assert [r["depth"] for r in res["rows"]] == [1, 2, 8] and res["reference_depth"] == trained_engine.depth
    assert all(math.isfinite(r["native_ppl"]) and math.isfinite(r["sharing_penalty_pct"]) for r in res["rows"])
    # R=1: one recurrence, terminal bank = the only bank → no sharing penalty
    assert res["rows"][0]["sharing_penalty_pct"] == pytest.approx(0.0, abs=1e-9)
    assert math.isfinite(res["extrapolation_pct"])
    png = plot_sweep(res, tmp_path / "sweep.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert parse_depths("4,1,2,4") == [1, 2, 4]
    for typo in ("4,1,,2", "1,2,", ","):  # an empty entry is a typo, not a depth to drop silently
        with pytest.raises(ConfigError, match="--depths: empty entry in"):
            parse_depths(typo)
    with pytest.raises(ConfigError, match="--depths: recurrence depth must be an integer >= 1, got 0"):
        parse_depths("1,0")  # the depth is named, not called "not an integer"
    with pytest.raises(ConfigError, match="--depths: 'x' is not an integer"):
        parse_depths("1,x")


def test_fixed_point_report_on_trained_model(trained_engine, val_data):
    from megaloop.inference.fixed_point import fixed_point_report

    rep = fixed_point_report(trained_engine.model, val_data.tokens[:2, :24], control_depth=5)
    assert rep["num_spans"] == 2 and len(rep["spans"]) == 2
    for row in rep["spans"]:
        assert {"prefix", "joint", "current", "state_gap", "kl", "control"} <= set(row)
        assert 1 <= row["joint"]["steps"] <= 1024
    if rep["num_qualified"]:
        assert rep["state_gap"]["max"] < 1e-4 and rep["kl"]["max"] < 1e-6


def test_bad_data_inputs(trained_engine, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_eval_data(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="--max-seqs"):
        load_eval_data("default", default_seq_len=128, max_seqs=0)
    data = load_eval_data("default", default_seq_len=128, max_seqs=1)
    with pytest.raises(ConfigError, match="--depth"):
        evaluate_ppl(trained_engine, data, depth=0)
    with pytest.raises(ConfigError, match="unknown protocol"):
        evaluate_ppl(trained_engine, data, protocols=("full",))


def test_a_seq_len_the_embedded_corpus_cannot_fill_names_seq_len(monkeypatch):
    """The converter's error (about training documents, with the build's temporary path) becomes one
    about --seq-len; other data errors pass through unchanged. (The real build takes a minute.)"""
    import megaloop.eval.ppl as ppl
    from megaloop.data.errors import DataError, NothingPackedError

    def fail(err):
        def read_rows(*_a, **_k):
            raise err
        return read_rows

    counts = "4285 training document(s) with 12,070,468 tokens after mixing; 881 held out for val/screen"
    monkeypatch.setattr(ppl, "_read_rows", fail(NothingPackedError(
        f"no sequence of 99999 tokens could be packed from /c/.tmp-1/corpus ({counts}); nothing was published",
        seq_len=99999, counts=counts)))
    with pytest.raises(ConfigError, match=r"--seq-len 99999: the embedded corpus \('--data default'\) cannot fill "
                                          r"one sequence of 99999 tokens \(4285 training document\(s\) with "
                                          r"12,070,468 tokens after mixing; 881 held out for val/screen\); use a "
                                          r"shorter --seq-len"):
        load_eval_data("default", seq_len=99999)
    monkeypatch.setattr(ppl, "_read_rows", fail(DataError("shard x is corrupt")))
    with pytest.raises(DataError, match="shard x is corrupt"):
        load_eval_data("default", seq_len=99999)


def test_max_seqs_takes_a_source_balanced_subset():
    """--max-seqs N on a set with a source column: the first N of the MixVal order (sources
    interleaved), not the first source's rows — the same rule as in-training validation."""
    from collections import Counter

    from megaloop.data.loaders import read_sources
    from megaloop.eval.ppl import load_eval_data

    sources = set(read_sources("default", seq_len=128))
    assert len(sources) >= 2
    n = 4 * len(sources)
    data = load_eval_data("default", seq_len=128, max_seqs=n)
    counts = Counter(data.sources)
    assert set(counts) == sources and set(counts.values()) == {4}


def test_a_sweep_of_one_depth_plots_its_point(tmp_path):
    """One row at the reference depth: the log axis had zero width (matplotlib's divide-by-zero
    warning) and the PNG held only the title and legend."""
    import warnings

    from megaloop.eval.depth_sweep import plot_sweep

    res = {"rows": [{"depth": 3, "native_ppl": 501.0}], "reference_depth": 3, "sharing": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        png = plot_sweep(res, tmp_path / "one.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
