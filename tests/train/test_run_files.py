"""The run keeps its data's tokenizer (``RUN/tokenizer.json``) only when it is the one the data was
tokenised with: a tokenizer file replaced since then (retrained into the same folder) is not copied."""

from __future__ import annotations

import hashlib
from pathlib import Path

from megaloop.train.run_files import keep_tokenizer


def _keep(tmp_path: Path, manifest: dict, data: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    keep_tokenizer(run, manifest, data, str(data))
    return run / "tokenizer.json"


def test_the_recorded_tokenizer_is_kept_and_a_replaced_one_is_not(tmp_path, capsys) -> None:
    data = tmp_path / "data"
    data.mkdir()
    tok = data / "tokenizer.json"
    tok.write_text('{"model": "old"}')
    sha = hashlib.sha256(tok.read_bytes()).hexdigest()
    # a path relative to the dataset's folder, and the sha the manifest records
    kept = _keep(tmp_path, {"tokenizer": {"path": "tokenizer.json", "sha256": sha}}, data)
    assert kept.read_text() == '{"model": "old"}'
    kept.unlink()
    tok.write_text('{"model": "retrained"}')  # the folder's tokenizer replaced after tokenising
    assert not _keep(tmp_path, {"tokenizer": {"path": str(tok), "sha256": sha}}, data).exists()
    err = capsys.readouterr().err
    assert f"warning: {tok} is not the tokenizer data.path={data} was tokenised with" in err
    assert f"the manifest records {sha[:12]}…" in err and "pass --tokenizer" in err
    # deleted (or moved) since the conversion: nothing to copy, and it is said (it was silent, and
    # generate later failed with "this engine has no tokenizer")
    tok.unlink()
    assert not _keep(tmp_path, {"tokenizer": {"path": str(tok), "sha256": sha}}, data).exists()
    err = capsys.readouterr().err
    assert f"warning: the tokenizer data.path={data} was tokenised with ({tok}, its manifest.json 'tokenizer') " \
           "is not there" in err


def test_init_weights_from_a_run_with_another_tokenizer_is_warned_about(tmp_path):
    """train.init_weights from a checkpoint trained with another tokenizer (an earlier release's embedded
    corpus: the audit's step-1 loss 7.91 where the right data gives 6.28) started silently."""
    import hashlib

    from megaloop.train.run_files import init_tokenizer_warning

    step = tmp_path / "old" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (tmp_path / "old" / "tokenizer.json").write_text("A")
    digest = lambda text: hashlib.sha256(text.encode()).hexdigest()  # noqa: E731
    cfg = {"data": {"path": "default"}, "model": {"seq_len": 128}}
    assert init_tokenizer_warning(step, cfg, {"tokenizer_sha256": digest("A")}) is None
    warn = init_tokenizer_warning(step, cfg, {"tokenizer_sha256": digest("B")})
    assert warn.startswith(f"train.init_weights={step} was trained with tokenizer {tmp_path / 'old' / 'tokenizer.json'}")
    assert "its embeddings map other token ids" in warn
    assert init_tokenizer_warning(step, {}, {"tokenizer_sha256": digest("B")}) is None  # nothing known: no word


def test_a_tokenizer_saved_again_by_transformers_is_the_same_tokenizer(tmp_path):
    """transformers writes a `padding` block into tokenizer.json when the tokenizer was used with
    padding=True before save_pretrained: the sha256 changed, and init_weights from a --from-hf
    round trip warned that its embeddings map other token ids (the loss showed they did not)."""
    import hashlib
    import json

    from megaloop.train.run_files import init_tokenizer_warning

    step = tmp_path / "rt" / "checkpoints" / "step_00000000"
    step.mkdir(parents=True)
    core = {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []}}
    (tmp_path / "rt" / "tokenizer.json").write_text(json.dumps({**core, "padding": {"pad_id": 0}}))
    data = tmp_path / "data"
    data.mkdir()
    (data / "tokenizer.json").write_text(json.dumps(core))
    manifest = {"tokenizer_sha256": hashlib.sha256((data / "tokenizer.json").read_bytes()).hexdigest(),
                "tokenizer": {"path": "tokenizer.json"}}
    cfg = {"data": {"path": "default"}, "model": {"seq_len": 128}}
    assert init_tokenizer_warning(step, cfg, manifest, data) is None
    other = {**core, "model": {**core["model"], "vocab": {"a": 1, "b": 0}}}
    (tmp_path / "rt" / "tokenizer.json").write_text(json.dumps({**other, "padding": {"pad_id": 0}}))
    assert "its embeddings map other token ids" in init_tokenizer_warning(step, cfg, manifest, data)
