"""megaloop.eval.copying: the in-context copying probe, against hand computations, an oracle copier
and a trained tiny model; and the parity harness's ``--add-copying`` on that model's run."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from megaloop.eval.copying import copy_probe, copy_scores, repeated_random_tokens
from tests.conftest import ROOT


def test_probe_sequences_repeat_and_are_fixed_by_the_seed() -> None:
    ids = repeated_random_tokens(3, 5, 50, seed=7, exclude=(0, 7))
    assert ids.shape == (3, 10) and ids.dtype == torch.int64
    assert torch.equal(ids[:, :5], ids[:, 5:])
    assert int(ids.min()) >= 1 and int(ids.max()) < 50
    assert torch.equal(ids, repeated_random_tokens(3, 5, 50, seed=7, exclude=(0, 7)))
    assert not torch.equal(ids, repeated_random_tokens(3, 5, 50, seed=8, exclude=(0, 7)))
    # excluded ids never appear, wherever they lie in the vocabulary
    many = repeated_random_tokens(64, 64, 6, exclude=(0, 3, 5))
    assert set(many.unique().tolist()) == {1, 2, 4}
    with pytest.raises(ValueError, match="half_len"):
        repeated_random_tokens(2, 1, 50)
    with pytest.raises(ValueError, match="fewer than 2"):
        repeated_random_tokens(2, 4, 3, exclude=(0, 1))


def _hand_ce(logits: torch.Tensor, ids: torch.Tensor, targets: range) -> float:
    vals = []
    for b in range(ids.shape[0]):
        for t in targets:  # token t predicted at position t - 1
            row = logits[b, t - 1].double()
            vals.append(float(torch.logsumexp(row, 0) - row[ids[b, t]]))
    return sum(vals) / len(vals)


def test_scores_equal_a_hand_computation() -> None:
    n, vocab = 6, 11
    ids = repeated_random_tokens(2, n, vocab, seed=1)
    logits = torch.randn(2, 2 * n, vocab, generator=torch.Generator().manual_seed(2))
    s = copy_scores(logits, ids)
    first, repeat = _hand_ce(logits, ids, range(1, n)), _hand_ce(logits, ids, range(n + 1, 2 * n))
    assert s["loss_first"] == pytest.approx(first, abs=1e-6)
    assert s["loss_repeat"] == pytest.approx(repeat, abs=1e-6)
    assert s["copy_gain"] == pytest.approx(first - repeat, abs=1e-6)
    assert (s["num_seqs"], s["half_len"]) == (2, n)


def _copier(ids: torch.Tensor, vocab: int, wrong_at_boundary: bool = False) -> torch.Tensor:
    """Uniform logits, except that from position n on it puts +50 on the token that followed the
    same position n tokens earlier (a perfect in-context copier)."""
    b, s = ids.shape
    n = s // 2
    logits = torch.zeros(b, s, vocab)
    for t in range(n, s - 1):  # position t predicts token t + 1 = token t + 1 - n
        logits[torch.arange(b), t, ids[:, t + 1 - n]] = 50.0
    if wrong_at_boundary:  # position n - 1 (predicting token n, left out of both means)
        logits[:, n - 1, 0] = 1e4
    return logits


def test_a_perfect_copier_gains_log_vocab_and_uniform_logits_gain_nothing() -> None:
    vocab = 64
    ids = repeated_random_tokens(4, 16, vocab, seed=3)
    s = copy_scores(_copier(ids, vocab), ids)
    assert s["loss_first"] == pytest.approx(math.log(vocab), abs=1e-5)
    assert s["loss_repeat"] == pytest.approx(0.0, abs=1e-5)
    assert s["copy_gain"] == pytest.approx(math.log(vocab), abs=1e-4)
    # the boundary target (token n, whose context never preceded it) counts in neither mean
    assert copy_scores(_copier(ids, vocab, wrong_at_boundary=True), ids) == s
    flat = copy_scores(torch.zeros(4, 32, vocab), ids)
    assert flat["copy_gain"] == pytest.approx(0.0, abs=1e-6)


def test_bad_shapes_are_refused() -> None:
    ids = repeated_random_tokens(2, 4, 10)
    with pytest.raises(ValueError, match="logits"):
        copy_scores(torch.zeros(2, 7, 10), ids)
    with pytest.raises(ValueError, match=r"\[b, 2n\]"):
        copy_scores(torch.zeros(2, 7, 10), ids[:, :7])


def _parity_copying():
    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    spec = importlib.util.spec_from_file_location("parity_copying", ROOT / "tools" / "bench" / "parity_copying.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_probe_on_a_trained_model_and_add_copying(trained_run: Path, tmp_path: Path) -> None:
    from megaloop.hf.load import load_model

    hf = load_model(trained_run).model.float().eval()
    half = 64  # the tiny preset's seq_len is 128
    vocab = hf.config.vocab_size
    with torch.no_grad():
        got = copy_probe(lambda ids: hf(input_ids=ids, num_recurrences=3).logits, vocab, num_seqs=4, half_len=half)
        ids = repeated_random_tokens(4, half, vocab)
        logits = hf(input_ids=ids, num_recurrences=3).logits
    assert got["loss_first"] == pytest.approx(_hand_ce(logits, ids, range(1, half)), abs=1e-4)
    assert got["loss_repeat"] == pytest.approx(_hand_ce(logits, ids, range(half + 1, 2 * half)), abs=1e-4)
    assert math.isfinite(got["copy_gain"]) and got["seed"] == 0

    pc = _parity_copying()
    run = tmp_path / "run_tiny30"
    run.symlink_to(trained_run, target_is_directory=True)
    result = tmp_path / "tiny30.json"
    base = {"label": "tiny30", "system": "megaloop", "steps": 30, "seed": 5, "losses": [1.0] * 30,
            "config": {"seq_len": 2 * half}}
    result.write_text(json.dumps(base))
    copying = pc.add_copying(run, result)
    written = json.loads(result.read_text())
    assert written["copying"] == copying and set(copying) == {str(d) for d in pc.DEPTHS}
    assert {k: v for k, v in written.items() if k != "copying"} == base  # nothing else changed
    torch.manual_seed(5)
    direct = copy_probe(lambda i: hf(input_ids=i, num_recurrences=1).logits, vocab, half_len=half, exclude=pc.SPECIAL_IDS)
    assert copying["1"]["copy_gain"] == pytest.approx(direct["copy_gain"], abs=1e-5)
    # a result of another run, or one whose step differs from the checkpoint's, is refused unchanged
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**base, "label": "other"}))
    with pytest.raises(SystemExit, match="run_other"):
        pc.add_copying(run, other)
    short = tmp_path / "short.json"
    short.write_text(json.dumps({**base, "label": "tiny30", "steps": 10}))
    with pytest.raises(SystemExit, match="step 30"):
        pc.add_copying(run, short)
    assert "copying" not in json.loads(short.read_text())
