"""megaloop.hf.load.load_model: one loader for native checkpoints and HF folders; in-memory
conversions are validated against the native logits, and a wrong mapping is refused."""

from __future__ import annotations

import re

import pytest
import torch

from tests.conftest import bpe_tokenizer
from tests.hf.test_hf_convert import VOCAB, build_native, perturb

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def checkpoint(megatron_world, tmp_path_factory):
    """A perturbed tiny GQA model saved as a run (checkpoint + run-dir tokenizer); its native logits."""
    from megaloop.config import RunConfig
    from megaloop.train.checkpoint import CheckpointManager

    run = tmp_path_factory.mktemp("load") / "run"
    bpe_tokenizer(run)  # RUN/tokenizer.json: found next to the checkpoints
    cfg, chunks = build_native(dict(injection="huginn_linear", num_query_groups=2))
    perturb(chunks[0])
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = chunks[0].eval()(ids, depth=3)
    ckpt = CheckpointManager(run / "checkpoints").save(7, chunks, None, common={
        "step": 7, "config": RunConfig(model=cfg).to_dict()})
    return run, ckpt, ids, logits


def test_checkpoint_loads_validated_with_the_runs_tokenizer(checkpoint, tmp_path):
    from megaloop.hf.load import is_hf_folder, load_model

    run, ckpt, ids, ref = checkpoint
    model, source = load_model(run, num_recurrences=3)
    assert source["kind"] == "checkpoint" and source["path"] == str(ckpt) and source["step"] == 7
    assert source["tokenizer"] == str(run / "tokenizer.json")
    assert source["validation"]["error"] <= 1e-4 and source["validation"]["depth"] == 3
    assert model.config.num_recurrences == 3 and model.config.eos_token_id == 0
    assert model.config.tokenizer_vocab_size == VOCAB and not model.training
    with torch.no_grad():
        err = (model(ids, use_cache=False).logits - ref).abs().max().item()
    assert err < 1e-4, err
    model.save_pretrained(tmp_path / "hf")
    assert is_hf_folder(tmp_path / "hf") and not is_hf_folder(run)
    hf, hf_source = load_model(tmp_path / "hf", dtype="bf16")
    assert hf_source == {"kind": "hf", "path": str(tmp_path / "hf"), "step": None, "tokenizer": None,
                         "validation": None}
    assert hf.dtype == torch.bfloat16


@pytest.mark.parametrize("corruption", ["scaled norm", "gate/up swapped"])
def test_a_wrong_in_memory_conversion_is_refused(checkpoint, monkeypatch, corruption):
    """The mapping is patched to be wrong (shapes still fit): loading refuses it with both errors
    named, and ``validate=False`` is the explicit way to skip the check."""
    import megaloop.hf.convert as convert
    from megaloop.hf.convert import ConversionError
    from megaloop.hf.load import load_model

    right = convert.native_to_hf_state_dict

    def wrong(sd, mcfg):
        out = dict(right(sd, mcfg))
        if corruption == "scaled norm":
            out["model.norm.weight"] = out["model.norm.weight"] * 1.5
        else:
            key = "model.core.0.mlp."
            out[key + "gate_proj.weight"], out[key + "up_proj.weight"] = (out[key + "up_proj.weight"],
                                                                          out[key + "gate_proj.weight"])
        return out

    monkeypatch.setattr(convert, "native_to_hf_state_dict", wrong)
    run, *_ = checkpoint
    with pytest.raises(ConversionError, match=r"does not reproduce the native model: validation \(FP32, eval, "
                                              r"depth \d+, .*max abs logit error"):
        load_model(run)
    model, source = load_model(run, validate=False)
    assert source["validation"] is None and model is not None


def test_kind_and_flag_checks(checkpoint, tmp_path):
    from megaloop.config_utils import ConfigError
    from megaloop.hf.load import check_model_path, load_model
    from megaloop.train.checkpoint import CheckpointError

    run, *_ = checkpoint
    assert check_model_path(run) == "checkpoint"
    with pytest.raises(CheckpointError, match="is not a megaloop HF folder"):
        load_model(run, kind="hf")
    with pytest.raises(ConfigError, match=f"--teacher {tmp_path / 'none'}: no such file or directory"):
        check_model_path(tmp_path / "none", "--teacher")
    with pytest.raises(ConfigError, match="--dtype: unknown dtype 'fp8'"):
        load_model(run, dtype="fp8")
    # an HF folder whose weights are missing (a partial export) is named, not a from_pretrained traceback
    bare = tmp_path / "hf_no_weights"
    bare.mkdir()
    (bare / "config.json").write_text('{"model_type": "megaloop"}')
    with pytest.raises(ConfigError, match="hf_no_weights has a megaloop config.json but no weights"):
        load_model(bare)


def test_a_tokenizer_larger_than_the_model_is_refused(checkpoint, tmp_path):
    """--tokenizer with more tokens than the model's vocabulary cannot be the one it was trained
    with: named as --tokenizer before any prompt is encoded (not blamed on the prompt)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    from megaloop.config_utils import ConfigError
    from megaloop.inference.engine import InferenceEngine

    run, *_ = checkpoint
    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, VOCAB + 50)}}
    big = tmp_path / "big" / "tokenizer.json"
    big.parent.mkdir()
    HFTokenizer(WordLevel(vocab, unk_token="<|endoftext|>")).save(str(big))
    with pytest.raises(ConfigError, match=f"--tokenizer {big}: its vocabulary \\({VOCAB + 50} tokens\\) is larger"):
        InferenceEngine.load(run, tokenizer=str(big), validate=False)


def test_a_tokenizer_smaller_than_the_model_is_warned_about(checkpoint, tmp_path, capfd):
    """A smaller --tokenizer ran without a word (its ids fit, its scores are meaningless): one
    stderr warning naming both sizes; the engine still loads (a deliberate sub-vocabulary works)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    from megaloop.inference.engine import InferenceEngine

    run, *_ = checkpoint
    small = tmp_path / "small" / "tokenizer.json"
    small.parent.mkdir()
    HFTokenizer(WordLevel({"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, 40)}},
                          unk_token="<|endoftext|>")).save(str(small))
    capfd.readouterr()
    engine = InferenceEngine.load(run, tokenizer=str(small), validate=False)
    err = capfd.readouterr().err
    assert engine.tokenizer is not None and engine.tokenizer.vocab_size == 40
    assert f"warning: --tokenizer {small}: its vocabulary (40 tokens) is smaller than the model's ({VOCAB})" in err, err
    InferenceEngine.load(run, validate=False)  # the run's own tokenizer: no warning
    assert "smaller than the model's" not in capfd.readouterr().err


def test_tokenizer_override_is_compared_with_the_runs_own_when_the_config_has_no_vocab(
        megatron_world, tmp_path, capfd):
    """A run's config holds model.vocab_size 0 (taken from the data): the native path measured the
    model's real vocabulary on the --tokenizer override itself, so a smaller one loaded silently and
    one between the run's size and the padded rows was accepted. Both are told apart from the run's
    own tokenizer now, as for an HF folder."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    from megaloop.config import RunConfig
    from megaloop.config_utils import ConfigError
    from megaloop.data.tokenizer import Tokenizer
    from megaloop.inference.engine import InferenceEngine
    from megaloop.train.checkpoint import CheckpointManager

    run = tmp_path / "run"
    own = Tokenizer(bpe_tokenizer(run)).vocab_size
    cfg, chunks = build_native(dict(injection="parcae_nonorm"))
    d = RunConfig(model=cfg).to_dict()
    d["model"]["vocab_size"] = 0  # as training writes it
    CheckpointManager(run / "checkpoints").save(3, chunks, None, common={"step": 3, "config": d})

    def word_level(n: int) -> str:
        path = tmp_path / f"w{n}" / "tokenizer.json"
        path.parent.mkdir()
        HFTokenizer(WordLevel({"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, n)}},
                              unk_token="<|endoftext|>")).save(str(path))
        return str(path)

    capfd.readouterr()
    small = word_level(40)
    InferenceEngine.load(run, tokenizer=small, validate=False)
    assert f"its vocabulary (40 tokens) is smaller than the model's ({own})" in capfd.readouterr().err
    between = word_level(own + 20)  # more than the run's, fewer than the embedding's 256 rows
    with pytest.raises(ConfigError, match=f"its vocabulary \\({own + 20} tokens\\) is larger than the model's \\({own}\\)"):
        InferenceEngine.load(run, tokenizer=between, validate=False)


def test_an_hf_folder_with_a_broken_config_json_is_named(tmp_path):
    """An unparsable config.json is named, not taken for "no HF folder" (which blamed a missing
    megaloop checkpoint and suggested `convert --from-hf`)."""
    from megaloop.config_utils import ConfigError
    from megaloop.hf.convert import ConversionError
    from megaloop.hf.load import check_model_path, load_model

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "megaloop",')  # truncated
    (hf / "model.safetensors").write_bytes(b"")
    cfg = re.escape(str(hf / "config.json"))
    with pytest.raises(ConversionError, match=f"^{cfg} is not valid JSON"):
        load_model(hf)
    with pytest.raises(ConfigError, match=f"^--checkpoint {re.escape(str(hf))}: {cfg} is not valid JSON"):
        check_model_path(hf, "--checkpoint")


def test_a_process_that_only_reads_a_checkpoint_computes_without_the_cpu_layer(checkpoint):
    """eval/generate/rl load a native checkpoint through megatron, then compute with plain PyTorch: the
    CPU layer's TorchFunctionMode (a Python dispatch on every torch call; decoding 1.4x slower) is left
    only when this process used megatron before; the next init_distributed enters it again."""
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("the CPU layer is installed only without CUDA")
    run, _, ids, logits = checkpoint
    code = f"""
import torch
from megaloop.hf.load import load_model
from megaloop.runtime.cpu_compat import redirect_active
model, _ = load_model({str(run)!r})
ids = torch.tensor({ids.tolist()!r})
with torch.no_grad():
    out = model(input_ids=ids, num_recurrences=3).logits
torch.save(out, {str(run / 'hf_logits.pt')!r})
print("ACTIVE_AFTER_LOAD", redirect_active())
from megaloop.runtime.parallel import ParallelDims, init_distributed
init_distributed(ParallelDims(world=1), 1234)
print("ACTIVE_AFTER_INIT", redirect_active())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert "ACTIVE_AFTER_LOAD False" in proc.stdout and "ACTIVE_AFTER_INIT True" in proc.stdout, proc.stderr[-3000:]
    out = torch.load(run / "hf_logits.pt")
    assert torch.allclose(out[..., :logits.shape[-1]], logits, atol=1e-5)
    # in this process megatron was in use (the module's world): loading leaves its layer on
    from megaloop.hf.load import load_model
    from megaloop.runtime.cpu_compat import redirect_active

    assert redirect_active()
    load_model(run)
    assert redirect_active()


def test_an_hf_folder_whose_weights_do_not_match_its_config_is_refused(tmp_path, capfd):
    """A config.json edited after the export (or copied from another one) loaded with random tensors
    where weights were missing (exit 0, transformers' generic warning), dropped stored tensors the
    config did not describe, and crashed with a traceback on a shape difference."""
    import json

    from megaloop.hf.errors import ConversionError
    from megaloop.hf.load import load_model
    from tests.inference.helpers import make_model

    def folder(name: str, edit: dict, **kw):
        path = tmp_path / name
        make_model(**kw).save_pretrained(path)
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **edit}))
        return path

    load_model(folder("ok", {}), kind="hf")  # an untouched export loads
    cases = {"missing": (folder("missing", {"state_readout": True}),
                         r"1 tensor\(s\) missing from the weights \(they would be random\): model\.state_readout\.weight"),
             "extra": (folder("extra", {"state_readout": False}, state_readout=True),
                       r"1 tensor\(s\) in the weights but not in the model config\.json describes \(they would be "
                       r"dropped\): model\.state_readout\.weight"),
             "shape": (folder("shape", {"intermediate_size": 96}),
                       r"tensors of another shape \(model\.coda\.0\.mlp\.down_proj\.weight \[32, \d+\] stored vs "
                       r"\[32, 96\]")}
    capfd.readouterr()
    for name, (path, why) in cases.items():
        with pytest.raises(ConversionError, match=rf"^HF folder {re.escape(str(path))}: its weights do not match its "
                                                  rf"config\.json: {why}"):
            load_model(path, kind="hf")
    assert "newly initialized" not in capfd.readouterr().err  # transformers' warning, replaced by the refusal
