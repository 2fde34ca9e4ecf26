"""``train.init_weights``: a fresh run starts from another checkpoint's model weights (a full
training checkpoint or a weights-only one, as ``convert --from-hf`` writes) with its own optimizer,
schedule and step count; another model is refused naming the field."""

from __future__ import annotations

import pytest
import torch

from megaloop.config import load_config
from megaloop.model.build import unwrap

pytestmark = pytest.mark.usefixtures("megatron_world", "one_thread")  # tests/conftest.py

SMALL = ["train.global_batch_size=4", "train.micro_batch_size=2", "train.max_steps=10",
         "optim.warmup_steps=1", "logging.progress=false"]


def _trainer(run_dir, *overrides: str, steps: int = 0):
    """A set-up Trainer after ``steps`` training steps."""
    from megaloop.train.trainer import Trainer

    t = Trainer(load_config("tiny", [*SMALL, *overrides]), run_dir)
    t.setup()
    for _ in range(steps):
        t.train_step()
    t.loader.close()
    return t


def _params(t) -> dict:
    return {n: p.detach().clone() for n, p in unwrap(t.model[0]).named_parameters()}


def test_a_fresh_run_starts_from_the_weights_of_another(tmp_path) -> None:
    src = _trainer(tmp_path / "src", steps=1)
    with torch.no_grad():
        for p in unwrap(src.model[0]).parameters():
            p.add_(0.25)  # weights no fresh init has
    full = src.save()  # with optimizer state
    weights_only = src.ckpt.save(7, src.model, None, common={"step": 7, "config": src.cfg.to_dict()})
    want = _params(src)
    src.close()
    # a full checkpoint, a weights-only one, a run dir (its newest checkpoint: the weights-only step 7)
    for i, init in enumerate((full, weights_only, tmp_path / "src")):
        t = _trainer(tmp_path / f"dst{i}", f"train.init_weights={init}")
        got = _params(t)
        assert all(torch.equal(got[n], want[n]) for n in want)
        assert t.step == 0 and t.scheduler.num_steps == 0
        t.close()
    assert full.name == "step_00000001"
    # the optimizer is built from the loaded weights: one update moves them by about the LR, not back to
    # a fresh init (BF16: its FP32 main copies are made when the optimizer is; loading after that fails here)
    t = _trainer(tmp_path / "dst_step", f"train.init_weights={full}", "model.bf16=true", steps=1)
    moved = max((p - want[n]).abs().max().item() for n, p in _params(t).items())
    assert 0 < moved < 0.05, moved
    t.close()
    fresh = _params(_trainer(tmp_path / "fresh"))
    assert not torch.equal(fresh["embedding.word_embeddings.weight"], want["embedding.word_embeddings.weight"])


def test_another_model_or_a_missing_checkpoint_is_refused(tmp_path) -> None:
    from megaloop.config_utils import ConfigError
    from megaloop.train.checkpoint import CheckpointError

    src = _trainer(tmp_path / "src", steps=1)
    src.save()
    src.close()
    with pytest.raises(ConfigError, match=r"was trained as another model .*qk_norm.*; start from it with "
                                          r"model.qk_norm=true"):
        _trainer(tmp_path / "a", f"train.init_weights={tmp_path / 'src'}", "model.qk_norm=false")
    with pytest.raises(CheckpointError, match=rf"^train.init_weights: checkpoint {tmp_path / 'none'} does not exist"):
        _trainer(tmp_path / "b", f"train.init_weights={tmp_path / 'none'}")
    # context extension (a larger RoPE base, another norm epsilon) from the weights is not another model;
    # as a resume it is (ModelConfig.RESUME_FIELDS)
    _trainer(tmp_path / "c", f"train.init_weights={tmp_path / 'src'}", "model.rope_base=50000",
             "model.norm_eps=1e-6").close()
    from megaloop.train.trainer import Trainer

    t = Trainer(load_config("tiny", [*SMALL, "model.rope_base=50000"]), tmp_path / "src", resume="auto")
    with pytest.raises(ConfigError, match=r"model.rope_base: checkpoint 10000.0, this run 50000.0"):
        t.setup()
    t.close()


def test_another_vocabulary_is_named(tmp_path) -> None:
    from megaloop.train.checkpoint import CheckpointError

    src = _trainer(tmp_path / "src", steps=1)
    src.save()
    vocab = src.vocab
    src.close()
    with pytest.raises(CheckpointError, match=r"^train.init_weights: .*word_embeddings.*; its vocabulary differs from "
                                              rf"this run's \({vocab + 128} tokens, from model.vocab_size\): train "
                                              r"on data tokenised with the checkpoint's tokenizer"):
        _trainer(tmp_path / "dst", f"train.init_weights={tmp_path / 'src'}", f"model.vocab_size={vocab + 128}")
    # a resume under another vocabulary: named too (the error named only the tensors' shapes; audit K)
    from megaloop.train.trainer import Trainer

    t = Trainer(load_config("tiny", [*SMALL, f"model.vocab_size={vocab + 128}"]), tmp_path / "src", resume="auto")
    with pytest.raises(CheckpointError, match=rf"word_embeddings.*; its vocabulary differs from this run's "
                                              rf"\({vocab + 128} tokens, from model.vocab_size\)"):
        t.setup()
    t.close()
    # the same vocabulary padded to another multiple: named as such, not as another vocabulary (review)
    t = Trainer(load_config("tiny", [*SMALL, "model.vocab_pad_multiple=1000"]), tmp_path / "src", resume="auto")
    with pytest.raises(CheckpointError, match=r"pads its vocabulary to a multiple of 128, this run to 1000: use "
                                              r"model.vocab_pad_multiple=128$"):
        t.setup()
    t.close()
    # and as train.init_weights: it blamed the tokenizer ("train on data tokenised with the checkpoint's")
    with pytest.raises(CheckpointError, match=r"^train.init_weights: .*pads its vocabulary to a multiple of 128, this "
                                              r"run to 1000: use model.vocab_pad_multiple=128$"):
        _trainer(tmp_path / "dst2", f"train.init_weights={tmp_path / 'src'}", "model.vocab_pad_multiple=1000")
