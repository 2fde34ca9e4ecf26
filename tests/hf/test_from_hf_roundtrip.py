"""HF → megaloop (``convert --from-hf``) keeps what the export records: the tokenizer's own vocabulary
(not the padded embedding rows) and a weightless QK-norm; an interrupted conversion leaves --out as it was."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def exported(megatron_world, tmp_path_factory):
    """A checkpoint with a 250-token vocabulary (embedding padded to 288 by a multiple of 96, not a power of
    two) and weightless QK-norm, exported."""
    from megaloop.config import RunConfig
    from megaloop.data.config import DataConfig
    from megaloop.hf.convert import convert_to_hf
    from megaloop.model.build import build_model
    from megaloop.model.config import ModelConfig
    from megaloop.train.checkpoint import CheckpointManager

    root = tmp_path_factory.mktemp("roundtrip")
    cfg = ModelConfig(hidden_size=64, num_heads=4, seq_len=32, vocab_size=250, vocab_pad_multiple=96, qk_norm=True, qk_norm_gain=False,
                      transformer_impl="local")
    chunks, _ = build_model(cfg, vocab_size=250, tp=1, pp=1, vpp=None, sequence_parallel=False, seed=5, ddp=False)
    conf = RunConfig(model=cfg, data=DataConfig(path=str(root / "no-data"))).to_dict()
    CheckpointManager(root / "run" / "checkpoints").save(3, chunks, None, common={"step": 3, "config": conf})
    from tokenizers import Tokenizer, models

    tok = root / "tokenizer.json"  # 250 tokens, as the model's vocabulary
    vocab = {f"t{i}": i for i in range(249)} | {"</s>": 249}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(tok))
    convert_to_hf(root / "run", root / "hf", validate=False, tokenizer=tok, log=lambda *_: None)
    return root


def test_the_round_trip_keeps_the_real_vocabulary_and_a_weightless_qk_norm(megatron_world, exported):
    """Before: the way back recorded the padded 256 rows as the vocabulary (a re-export's
    tokenizer_vocab_size 256, generation free to sample the 6 padding ids) and dropped qk_norm_gain=false
    (train.init_weights then refused the original config). A padding multiple that is not a power of
    two <= 128 (96 here) still lost the real vocabulary (audit L: 3000 gave 6000 rows as the vocabulary)."""
    from megaloop.hf.convert import convert_to_hf
    from megaloop.hf.from_hf import convert_from_hf
    from megaloop.train.checkpoint import CheckpointManager

    hf = json.loads((exported / "hf" / "config.json").read_text())
    assert (hf["vocab_size"], hf["tokenizer_vocab_size"], hf["qk_norm_gain"]) == (288, 250, False)
    back = convert_from_hf(exported / "hf", exported / "back" / "checkpoints")
    model = CheckpointManager.saved_model_config(back)
    assert (model["vocab_size"], model["vocab_pad_multiple"], model["qk_norm_gain"]) == (250, 96, False), model
    convert_to_hf(exported / "back", exported / "hf2", validate=False, log=lambda *_: None)
    again = json.loads((exported / "hf2" / "config.json").read_text())
    assert (again["vocab_size"], again["tokenizer_vocab_size"], again["qk_norm_gain"]) == (288, 250, False)


def test_an_older_export_without_the_recorded_multiple_keeps_the_real_vocabulary():
    """Exports before this release do not record vocab_pad_multiple: any multiple that pads the tokenizer's
    vocabulary to the embedding's rows is taken (the most factors of two, then the smallest)."""
    from megaloop.hf.configuration_megaloop import MegaloopConfig
    from megaloop.hf.convert import _native_vocab

    assert _native_vocab(MegaloopConfig(vocab_size=6000, tokenizer_vocab_size=4096)) == (4096, 2000)
    assert _native_vocab(MegaloopConfig(vocab_size=6000, tokenizer_vocab_size=4096, vocab_pad_multiple=3000)) == \
        (4096, 3000)
    assert _native_vocab(MegaloopConfig(vocab_size=50304, tokenizer_vocab_size=50257)) == (50257, 128)
    assert _native_vocab(MegaloopConfig(vocab_size=4096)) == (4096, 128)


def test_an_interrupted_from_hf_leaves_out_as_it_was(megatron_world, exported, monkeypatch):
    """Ctrl-C / SIGTERM during the save: the tokenizer files (and the step's temporary folder) stayed in
    --out, and running the same command again was refused as "not empty"."""
    from megaloop.hf.from_hf import convert_from_hf
    from megaloop.train import checkpoint

    hf = exported / "hf"
    assert (hf / "tokenizer.json").is_file()
    real = checkpoint.CheckpointManager.save

    def interrupted(self, *a, **k):
        (self.root / ".tmp_step_00000000").mkdir(parents=True)
        raise KeyboardInterrupt
    for out, empty_before in ((exported / "new_out", False), (exported / "empty_out", True)):
        if empty_before:
            out.mkdir()
        monkeypatch.setattr(checkpoint.CheckpointManager, "save", interrupted)
        with pytest.raises(KeyboardInterrupt):
            convert_from_hf(hf, out)
        assert (list(out.iterdir()) == [] if empty_before else not out.exists())
        monkeypatch.setattr(checkpoint.CheckpointManager, "save", real)
        assert convert_from_hf(hf, out) == out / "step_00000000" and (out / "tokenizer.json").is_file()


def test_a_killed_from_hf_is_cleared_by_the_same_command(megatron_world, exported, capsys):
    """SIGKILL skips the clean-up above: --out kept the tokenizer files and a partial .tmp_step_*, and the
    same command was refused ("--out is not empty") without a way out. Those leftovers (and only those:
    tokenizer files equal to the folder's) are removed with a note, and the conversion runs."""
    import shutil

    from megaloop.hf.convert_cli import main

    hf, out = exported / "hf", exported / "killed_out"
    out.mkdir()
    shutil.copyfile(hf / "tokenizer.json", out / "tokenizer.json")
    (out / ".tmp_step_00000000" / "half").mkdir(parents=True)
    assert main(["--from-hf", "--checkpoint", str(hf), "--out", str(out)]) == 0
    assert "left by an earlier --from-hf that did not finish" in capsys.readouterr().err
    assert (out / "step_00000000").is_dir() and not (out / ".tmp_step_00000000").exists()
    other = exported / "other_out"  # a folder with anything else stays refused
    (other / ".tmp_step_00000000").mkdir(parents=True)
    (other / "notes.txt").write_text("mine")
    assert main(["--from-hf", "--checkpoint", str(hf), "--out", str(other)]) == 2
    assert "is not empty" in capsys.readouterr().err and (other / "notes.txt").is_file()


def test_hf_generate_settings_a_checkpoint_cannot_keep_are_named(megatron_world, exported, capsys):
    """A folder saved with prefill_recurrences / decode_recurrences / kv_cache_mode (the README's own
    example) lost them on the way back, silently (a re-export's plain forward differed by logits of 1.75)."""
    import shutil

    from megaloop.hf.from_hf import convert_from_hf

    folder = exported / "hf_settings"
    shutil.copytree(exported / "hf", folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "prefill_recurrences": 8, "decode_recurrences": 4,
                                                    "kv_cache_mode": "per_visit"}))
    capsys.readouterr()
    convert_from_hf(folder, exported / "back_settings" / "checkpoints")
    err = capsys.readouterr().err
    assert "config.json sets prefill_recurrences=8, decode_recurrences=4, kv_cache_mode=per_visit, which a megaloop " \
           "checkpoint does not keep" in err, err
    convert_from_hf(exported / "hf", exported / "back_plain" / "checkpoints")
    assert "does not keep" not in capsys.readouterr().err
