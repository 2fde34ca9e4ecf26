"""tools/bench/parity_transfer.py (``parity.py --check-forward``): the weight-layout mapping into the
reference implementations. The references themselves are not in the project, so the end-to-end check
runs only where a checkout is given (README, "Learning parity"); these tests pin the parts that
decide whether copied weights compute the same function."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "tools" / "bench"))
import parity_transfer as pt  # noqa: E402

from megaloop.hf.configuration_megaloop import MegaloopConfig  # noqa: E402
from megaloop.hf.layers_megaloop import apply_rotary, rotary_cos_sin  # noqa: E402


def _interleaved_rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Complex rotation of consecutive pairs (2j, 2j+1) by pos·base^(−2j/hd): the references' layout."""
    hd = x.shape[-1]
    theta = base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    rot = torch.polar(torch.ones(positions.numel(), hd // 2, dtype=torch.float64),
                      positions.double()[:, None] * theta)  # [s, hd/2]
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], hd // 2, 2).contiguous())
    return torch.view_as_real(xc * rot).reshape(x.shape)


def test_rope_permutation_turns_rotate_half_into_interleaved() -> None:
    torch.manual_seed(0)
    b, heads, s, hd, base = 2, 3, 7, 16, 50000.0
    t = torch.randn(b, heads, s, hd, dtype=torch.float64)
    pos = torch.arange(s)
    cos, sin = rotary_cos_sin(pos[None].expand(b, s), hd, base, torch.float64)
    p = pt.rope_permutation(hd)
    assert sorted(p.tolist()) == list(range(hd))
    ours = apply_rotary(t, cos, sin)[..., p]  # megaloop's rotate-half RoPE, then permuted
    theirs = _interleaved_rope(t[..., p], pos, base)  # permuted first, then the references' RoPE
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)  # megaloop builds the angles in float32
    # a wrong layout (identity) does not match: the test can fail
    assert (apply_rotary(t, cos, sin) - _interleaved_rope(t, pos, base)).abs().max() > 0.1


def test_permuted_projections_keep_attention_scores() -> None:
    torch.manual_seed(1)
    heads, hd, d, s = 4, 8, 32, 5
    wq, wk, x = torch.randn(heads * hd, d), torch.randn(heads * hd, d), torch.randn(s, d)
    bias = torch.randn(heads, hd)
    p = pt.rope_permutation(hd)
    q = (x @ wq.T).view(s, heads, hd) + bias
    q2 = (x @ pt.permute_heads(wq, heads, hd).T).view(s, heads, hd) + pt.permute_heads(bias, heads, hd)
    torch.testing.assert_close(q2, q[..., p])
    k = (x @ wk.T).view(s, heads, hd)
    k2 = (x @ pt.permute_heads(wk, heads, hd).T).view(s, heads, hd)
    torch.testing.assert_close(torch.einsum("shd,thd->hst", q2, k2), torch.einsum("shd,thd->hst", q, k))


def _cfg(**kw) -> MegaloopConfig:
    base = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, n_prelude=1, n_core=2, n_coda=1)
    return MegaloopConfig(**{**base, **kw})


def test_transfer_problems_name_the_fields_a_reference_cannot_express() -> None:
    parcae = _cfg(injection="parcae_decay", state_readout=True, qk_norm=True, tie_word_embeddings=True)
    assert pt.transfer_problems(parcae, "parcae") == []
    huginn = _cfg(injection="huginn_linear", sandwich_norm=True, exit_norm=False, tie_word_embeddings=True,
                  adapter_bias=False)
    assert pt.transfer_problems(huginn, "huginn") == []
    biased = pt.transfer_problems(_cfg(injection="huginn_linear", sandwich_norm=True, exit_norm=False,
                                       tie_word_embeddings=True), "huginn")
    assert biased == ["adapter_bias=True (the huginn reference needs False)"]  # Huginn's adapter has no bias
    with pytest.raises(SystemExit, match="cannot be expressed as the parcae reference: injection="):
        pt.require_transferable(_cfg(injection="huginn_linear"), "parcae")
    bad = pt.transfer_problems(_cfg(injection="parcae_nonorm", tie_word_embeddings=False), "parcae")
    assert any(b.startswith("injection='parcae_nonorm'") for b in bad)
    assert any(b.startswith("tie_word_embeddings=False") for b in bad)
    assert any(b.startswith("state_readout=False") for b in bad)
    assert any(b.startswith("exit_norm=True") for b in pt.transfer_problems(_cfg(injection="huginn_linear"), "huginn"))
    with pytest.raises(ValueError, match="unknown reference"):
        pt.transfer_problems(parcae, "other")


def test_check_forward_refuses_bad_arguments(tmp_path, capsys) -> None:
    sys.argv = ["parity.py"]
    import parity

    with pytest.raises(SystemExit):
        parity.main(["--check-forward", str(tmp_path), "--system", "megaloop"])
    assert "--system must name the reference" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--ref-path: .* has no parcae_lm/models/parcae/parcae.py"):
        parity.main(["--check-forward", str(tmp_path), "--system", "parcae", "--ref-path", str(tmp_path / "x")])
    fake = tmp_path / "parcae" / "parcae_lm" / "models" / "parcae"
    fake.mkdir(parents=True)
    (fake / "parcae.py").write_text("")
    with pytest.raises(SystemExit):
        parity.main(["--check-forward", str(tmp_path / "missing"), "--system", "parcae",
                     "--ref-path", str(tmp_path / "parcae")])
    assert "does not exist" in capsys.readouterr().err


def test_check_training_refuses_bad_arguments(tmp_path, capsys) -> None:
    import parity

    for argv, msg in ((["--system", "parcae", "--ref-path", str(tmp_path)], "--system must be huginn"),
                      (["--system", "huginn", "--ref-path", str(tmp_path), "--steps", "10"], "must lie in [1, --steps=10]"),
                      (["--system", "huginn", "--ref-path", str(tmp_path), "--check-depth", "0"], "--check-depth: must be >= 1")):
        with pytest.raises(SystemExit):
            parity.main(["--check-training", "20", "--out", str(tmp_path / "o")] + argv)
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_report_of_a_folder_without_training_results_says_so(tmp_path) -> None:
    import parity

    (tmp_path / "forward_parcae.json").write_text('{"check": "forward", "rows": []}')
    with pytest.raises(SystemExit, match="no training results"):
        parity.main(["--report", str(tmp_path)])


def test_hf_from_trainer_computes_the_trainers_function(megatron_world, tmp_path) -> None:
    """--check-training copies the trainer's live weights (no checkpoint) into an HF model, which is
    then copied into Huginn's: that model must compute the trainer's function, before and after a step."""
    import types

    import parity
    from parity_train_check import FIXED, _hf_from_trainer

    from megaloop.model.build import unwrap

    args = types.SimpleNamespace(base="tiny", steps=10, lr=3e-3, batch=4, micro_batch=4, seed=1234, mean_depth=5.0,
                                 bptt_window=4)
    t = parity._trainer(args, parity.MEGALOOP_CONFIGS["huginn_matched"] + FIXED + ["depth.depth=5"], tmp_path / "run")
    ids = torch.randint(0, t.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    errors, logits = [], []
    for step in range(2):
        if step:
            t.train_step()
        hf = _hf_from_trainer(t).eval()
        native = unwrap(t.model[0]).eval()
        with torch.no_grad():
            want = native(ids, depth=5)
            got = hf(ids, use_cache=False, num_recurrences=5).logits
        native.train()
        errors.append((got - want).abs().max().item())
        logits.append(want)
    assert max(errors) < 1e-4, errors
    # the copy is of the current weights: one step changed the logits by far more than that
    assert (logits[1] - logits[0]).abs().max().item() > 1e-3
