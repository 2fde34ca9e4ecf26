"""The trainer records what it trains on: ``RUN/data.json`` with the data's resolved path, build
fingerprint and content fingerprint (the one `megaloop reproduce --merge` compares)."""

from __future__ import annotations

import json

import pytest

from megaloop.config import load_config
from megaloop.data.fingerprint import content_fingerprint

pytestmark = pytest.mark.usefixtures("megatron_world", "one_thread")  # tests/conftest.py

SMALL = ["train.global_batch_size=4", "train.micro_batch_size=2", "train.max_steps=10",
         "optim.warmup_steps=1", "logging.progress=false"]


def _record(tmp_path, name: str, *overrides: str) -> dict:
    from megaloop.train.trainer import Trainer

    t = Trainer(load_config("tiny", [*SMALL, *overrides]), tmp_path / name)
    t.setup()
    t.loader.close()
    return json.loads((tmp_path / name / "data.json").read_text())


def test_data_json_records_the_content(tmp_path, capsys) -> None:
    from megaloop.data.synthetic import write_synthetic_mds

    a = _record(tmp_path, "a")
    assert "data.val_path is not set" not in capsys.readouterr().out  # the embedded corpus has its own
    b = _record(tmp_path, "b", "train.seed=7", "parallel.sequence_parallel=true")  # another order of the same data
    # sequence parallelism at TP=1 (as Megatron-LM: dropped with a word; it was dropped silently)
    assert "note: parallel.sequence_parallel=true has no effect at parallel.tp=1; training without it" in \
        capsys.readouterr().out
    assert a["content"] == b["content"] == content_fingerprint(a["path"])
    assert a["content"]["samples"] > 0 and a["manifest_fingerprint"]
    write_synthetic_mds(tmp_path / "syn", 64, 128, vocab_size=4096, seed=3)
    c = _record(tmp_path, "c", f"data.path={tmp_path / 'syn'}", "model.vocab_size=4096")
    assert f"note: data.val_path is not set: this run on {tmp_path / 'syn'} reports no validation loss" in \
        capsys.readouterr().out
    assert c["path"] == str(tmp_path / "syn") and c["content"]["sha256"] != a["content"]["sha256"]


def test_a_relative_data_path_is_recorded_absolute(tmp_path, monkeypatch) -> None:
    from megaloop.data.synthetic import write_synthetic_mds

    write_synthetic_mds(tmp_path / "syn", 64, 128, vocab_size=4096, seed=3)
    monkeypatch.chdir(tmp_path)
    rec = _record(tmp_path, "rel", "data.path=syn", "model.vocab_size=4096")
    assert rec["path"] == str((tmp_path / "syn").resolve())


def test_a_validation_set_of_another_tokenizer_is_refused(tmp_path) -> None:
    import types

    from megaloop.config_utils import ConfigError
    from megaloop.train.trainer import Trainer

    val = tmp_path / "val"
    val.mkdir()
    (val / "manifest.json").write_text(json.dumps({"seq_len": 64, "tokenizer_sha256": "b" * 64}))
    fake = types.SimpleNamespace(seq=128, mbs=2, cfg=load_config("tiny", [f"data.path={tmp_path / 'train'}"]))
    with pytest.raises(ConfigError, match=rf"^data.val_path: {val} was tokenised with tokenizer sha256 bbbbbbbbbbbb…, "
                                          rf"the training data \({tmp_path / 'train'}\) with aaaaaaaaaaaa…"):
        Trainer._resolve_val(fake, str(val), {"tokenizer": {"sha256": "a" * 64}})
    assert Trainer._resolve_val(fake, str(val), {"tokenizer_sha256": "b" * 64}) == (str(val), 64)
    assert Trainer._resolve_val(fake, str(val), {}) == (str(val), 64)  # training data without a record: no check


def test_a_validation_set_that_cannot_be_read_stops_the_set_up(tmp_path) -> None:
    """The validation batches were first read at the first evaluation: a bad token id there ended the run
    after its first steps, with nothing saved. They are read once at set-up now, before the run dir."""
    import json

    from megaloop.data.errors import DataError
    from megaloop.data.synthetic import write_synthetic_mds
    from megaloop.train.trainer import Trainer

    write_synthetic_mds(tmp_path / "train", 64, 128, vocab_size=4096, seed=3)
    write_synthetic_mds(tmp_path / "val", 16, 128, vocab_size=4096, seed=4)
    man = json.loads((tmp_path / "val" / "manifest.json").read_text())
    (tmp_path / "val" / "manifest.json").write_text(json.dumps({**man, "vocab_size": 100}))
    cfg = load_config("tiny", [*SMALL, f"data.path={tmp_path / 'train'}", f"data.val_path={tmp_path / 'val'}",
                               "model.vocab_size=4096"])
    t = Trainer(cfg, tmp_path / "run")
    with pytest.raises(DataError, match=rf"^data.val_path={tmp_path / 'val'}: dataset {tmp_path / 'val'}: token id "
                                        r"\d+ outside the vocabulary \[0, 100\)"):
        t.setup()
    t.loader.close()
    t.close(refused=True)  # what Trainer.run does when the set-up fails
    assert not (tmp_path / "run").exists()
