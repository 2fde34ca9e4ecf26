"""CheckpointManager.load: Transformer Engine-style unsaved ``_extra_state`` is tolerated, any other
missing key is an error naming the checkpoint."""

import pytest
import torch

from megaloop.model.build import build_model, unwrap
from megaloop.model.config import ModelConfig
from megaloop.train.checkpoint import CheckpointError, CheckpointManager


class ExtraStateOnly(torch.nn.Module):
    """Like TE's core attention: reports ``_extra_state`` in state_dict(), has no sharded state."""

    def get_extra_state(self):
        return torch.zeros(1)

    def set_extra_state(self, state):
        pass


class WithWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2))


def _chunks():
    cfg = ModelConfig(hidden_size=32, num_heads=2, seq_len=8, vocab_size=64)
    return build_model(cfg, vocab_size=64, tp=1, pp=1, vpp=None, sequence_parallel=False, seed=1, ddp=False)[0]


def _attach(chunks, factory):
    for layer in unwrap(chunks[0]).core:
        layer.self_attention.core_attention.stub = factory()


def test_unsaved_extra_state_is_tolerated(megatron_world, tmp_path):
    src = _chunks()
    path = CheckpointManager(tmp_path).save(1, src, None, common={"step": 1})
    dst = _chunks()
    with torch.no_grad():
        for p in dst[0].parameters():
            p.zero_()
    _attach(dst, ExtraStateOnly)
    assert any(k.endswith("core_attention.stub._extra_state") for k in unwrap(dst[0]).state_dict())
    CheckpointManager(tmp_path).load(path, dst)
    for (n, a), b in zip(unwrap(src[0]).named_parameters(), unwrap(dst[0]).parameters()):
        assert torch.equal(a, b), n


def test_other_missing_keys_fail_naming_the_checkpoint(megatron_world, tmp_path):
    path = CheckpointManager(tmp_path).save(1, _chunks(), None, common={"step": 1})
    dst = _chunks()
    _attach(dst, WithWeight)
    with pytest.raises(CheckpointError, match=f"checkpoint {path} does not match the model: missing"):
        CheckpointManager(tmp_path).load(path, dst)


def test_a_weights_only_checkpoint_cannot_resume_a_run(megatron_world, tmp_path):
    path = CheckpointManager(tmp_path).save(0, _chunks(), None, common={"step": 0, "source": "hf"})
    with pytest.raises(CheckpointError, match=f"checkpoint {path} holds model weights only, no optimizer state"):
        CheckpointManager(tmp_path).load(path, _chunks(), optimizer=object())
    CheckpointManager(tmp_path).load(path, _chunks())  # without an optimizer it loads
