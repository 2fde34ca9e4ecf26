"""Which tokenizer a run's checkpoint is exported / evaluated with (``megaloop.hf.convert.find_tokenizer``):
the run's own copy first, a data manifest's tokenizer only when its sha256 is the recorded one (refused
naming both otherwise), ``--tokenizer`` always; a relative ``data.path`` found from the run directory,
not the current directory."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from megaloop.hf.convert import ConversionError, find_tokenizer
from tests.conftest import bpe_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def manifest(folder: Path, tok: str | Path, sha256: str, fingerprint: str = "fp-real") -> Path:
    return write(folder / "manifest.json", json.dumps({"fingerprint": fingerprint, "tokenizer": {
        "path": str(tok), "sha256": sha256}}))


def run_layout(root: Path, data_path: str, *, own: str | None = None, fingerprint: str | None = "fp-real"):
    """(run_cfg, step dir) of RUN = root/runs/x, trained on ``data_path``."""
    run = root / "runs" / "x"
    step = run / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    if own is not None:
        write(run / "tokenizer.json", own)
    if fingerprint:
        write(run / "data.json", json.dumps({"path": data_path, "manifest_fingerprint": fingerprint}))
    return {"data": {"path": data_path}}, step


def test_the_runs_own_copy_comes_before_a_retrained_tokenizer(tmp_path):
    tok = write(tmp_path / "tok" / "tokenizer.json", "A")
    manifest(tmp_path / "data", tok, sha(tok))
    cfg, step = run_layout(tmp_path, str(tmp_path / "data"), own="A")
    write(tok, "B")  # retrained into the same folder
    assert find_tokenizer(cfg, step) == step.parent.parent / "tokenizer.json"
    assert find_tokenizer(cfg, step, tmp_path / "tok") == tok  # --tokenizer: the user's choice


def test_a_manifest_tokenizer_is_used_only_with_the_recorded_sha256(tmp_path):
    tok = write(tmp_path / "tok" / "tokenizer.json", "A")
    want = sha(tok)
    manifest(tmp_path / "data", tok, want)
    cfg, step = run_layout(tmp_path, str(tmp_path / "data"))  # a run without its own copy
    assert find_tokenizer(cfg, step) == tok
    write(tok, "B")
    with pytest.raises(ConversionError) as err:
        find_tokenizer(cfg, step)
    msg = str(err.value)
    assert str(tok) in msg and sha(tok) in msg and want in msg and str(tmp_path / "data" / "manifest.json") in msg
    assert "--tokenizer" in msg
    assert find_tokenizer(cfg, step, tok) == tok  # an explicit --tokenizer is not second-guessed
    # a manifest that records no sha256 cannot vouch for its tokenizer either
    write(tmp_path / "data" / "manifest.json", json.dumps({"fingerprint": "fp-real", "tokenizer": {"path": str(tok)}}))
    with pytest.raises(ConversionError, match="no sha256"):
        find_tokenizer(cfg, step)


def test_a_relative_data_path_is_the_runs_not_the_current_directorys(tmp_path, monkeypatch):
    # training ran in tmp_path: `--run-dir runs/x data.path=mds`; the manifest's tokenizer path is relative too
    real = write(tmp_path / "tok" / "tokenizer.json", "A")
    manifest(tmp_path / "mds", "tok/tokenizer.json", sha(real))
    cfg, step = run_layout(tmp_path, "mds")
    # the current directory holds another dataset called mds (self-consistent, another fingerprint)
    other = tmp_path / "elsewhere"
    decoy = write(other / "tok" / "tokenizer.json", "C")
    manifest(other / "mds", "tok/tokenizer.json", sha(decoy), fingerprint="fp-other")
    monkeypatch.chdir(other)
    assert find_tokenizer(cfg, step) == tmp_path / "tok" / "tokenizer.json"
    # the run's data rebuilt in place with another tokenizer: self-consistent, but not what the run trained on
    retok = write(tmp_path / "tok2" / "tokenizer.json", "D")
    manifest(tmp_path / "mds", retok, sha(retok), fingerprint="fp-rebuilt")
    with pytest.raises(ConversionError, match=r"mds/manifest.json has fingerprint fp-rebuilt…, the run trained on "
                                              r"fp-real…"):
        find_tokenizer(cfg, step)
    manifest(tmp_path / "mds", "tok/tokenizer.json", sha(real))
    # without data.json (no recorded fingerprint) the run directory's side is still looked at first
    (step.parent.parent / "data.json").unlink()
    assert find_tokenizer(cfg, step) == tmp_path / "tok" / "tokenizer.json"


def test_the_embedded_default_run_keeps_its_copy(tmp_path):
    cfg, step = run_layout(tmp_path, "default", own="A", fingerprint=None)
    assert find_tokenizer(cfg, step) == step.parent.parent / "tokenizer.json"


def test_export_and_engine_use_the_runs_tokenizer_after_a_retrain(megatron_world, tmp_path):
    """The tokenswap repro at unit scale: a checkpoint whose data folder's tokenizer was retrained
    exports (and loads for eval/generate/rl) with the run's copy, and its vocabulary sets
    ``tokenizer_vocab_size``."""
    from megaloop.config import RunConfig
    from megaloop.data.config import DataConfig
    from megaloop.data.tokenizer import Tokenizer
    from megaloop.hf.convert import convert_to_hf
    from megaloop.hf.load import load_model
    from megaloop.model.build import build_model
    from megaloop.model.config import ModelConfig
    from megaloop.train.checkpoint import CheckpointManager

    tok = bpe_tokenizer(tmp_path / "tok", 120, "hello world, looped models think longer")
    manifest(tmp_path / "data", tok, sha(tok))
    run = tmp_path / "run"
    run.mkdir()
    (run / "tokenizer.json").write_bytes(tok.read_bytes())  # what training copies
    vocab_a = Tokenizer(tok).vocab_size
    cfg = ModelConfig(hidden_size=64, num_heads=4, seq_len=32, vocab_size=0)
    chunks, _ = build_model(cfg, vocab_size=256, tp=1, pp=1, vpp=None, sequence_parallel=False, seed=1, ddp=False)
    CheckpointManager(run / "checkpoints").save(4, chunks, None, common={
        "step": 4, "config": RunConfig(model=cfg, data=DataConfig(path=str(tmp_path / "data"))).to_dict()})
    bpe_tokenizer(tmp_path / "tok", 60, "another corpus entirely")  # retrained into the same folder
    assert Tokenizer(tok).vocab_size != vocab_a
    rep = convert_to_hf(run, tmp_path / "hf", validate=False, log=lambda *_: None)
    assert rep["tokenizer"] == str(run / "tokenizer.json") and rep["tokenizer_vocab_size"] == vocab_a
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == (run / "tokenizer.json").read_text()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tokenizer_vocab_size"] == vocab_a
    model, source = load_model(run, validate=False)
    assert source["tokenizer"] == str(run / "tokenizer.json") and model.config.tokenizer_vocab_size == vocab_a
    # without the run's copy nothing valid is left: refused, and --tokenizer (eval, generate, rl, distill
    # through load_model / InferenceEngine.load) is the way past it, setting the vocabulary too
    good = tmp_path / "good_tokenizer.json"
    good.write_bytes((run / "tokenizer.json").read_bytes())
    (run / "tokenizer.json").unlink()
    from megaloop.hf.convert import ConversionError
    from megaloop.inference.engine import InferenceEngine

    with pytest.raises(ConversionError, match="--tokenizer"):
        load_model(run, validate=False)
    model, source = load_model(run, validate=False, tokenizer=good)
    assert source["tokenizer"] == str(good) and model.config.tokenizer_vocab_size == vocab_a
    engine = InferenceEngine.load(run, validate=False, tokenizer=str(good))
    assert engine.model.config.tokenizer_vocab_size == vocab_a


def test_an_old_run_on_another_releases_embedded_corpus_is_refused(tmp_path):
    """A run from before runs kept their tokenizer, on an earlier release's embedded corpus (another BPE of
    the same vocabulary size): its checkpoints were scored, exported and generated with this release's
    tokenizer, silently (an audit: PPL 2731.6 where its own tokenizer gives 692.4)."""
    import torch

    from megaloop.data.default_corpus import ensure_default_tokenizer
    from megaloop.data.loaders import resolve_data_path
    from megaloop.data.streaming import load_manifest

    now = load_manifest(resolve_data_path("default", 128, None, "train"))
    cfg, step = run_layout(tmp_path, "default", fingerprint=None)  # no tokenizer.json, no data.json
    cfg["model"] = {"seq_len": 128}
    loader = {"version": 1, "dataset_fingerprint": now["fingerprint"], "num_samples": now["num_sequences"]}
    (step / "metadata.json").write_text(json.dumps({  # what megatron's reader takes for a checkpoint
        "sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
        "common_backend_version": 1}))
    torch.save({"common": {"loader": [loader]}}, step / "common.pt")
    assert sha(find_tokenizer(cfg, step)) == sha(Path(ensure_default_tokenizer()))  # this corpus: its tokenizer
    torch.save({"common": {"loader": [dict(loader, dataset_fingerprint="fp-old", num_samples=1019)]}},
               step / "common.pt")
    with pytest.raises(ConversionError, match=r"trained on an embedded corpus other than this installation's \(1019 "
                                              rf"sequences; this one's has {now['num_sequences']}: .* pass --tokenizer"):
        find_tokenizer(cfg, step)
    own = write(tmp_path / "old_tok" / "tokenizer.json", "OLD")
    assert find_tokenizer(cfg, step, own) == own  # --tokenizer: the way on
    # the earlier release's set still in the run's cache: its own tokenizer, found by the loader's fingerprint
    old_set = tmp_path / "oldcache" / "default-0123456789abcdef"
    manifest(old_set / "train", own, sha(own), fingerprint="fp-old")
    cfg["data"]["cache_dir"] = str(tmp_path / "oldcache")
    assert find_tokenizer(cfg, step) == own
    # a folder whose name starts with "default" is no embedded set (it crashed the check)
    assert find_tokenizer({"data": {"path": "default_data/train"}, "model": {"seq_len": 128}}, step) is None
