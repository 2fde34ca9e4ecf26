"""The conversion check names a diverged checkpoint as such (its logits are not finite), not as a
conversion that does not reproduce the native model ("max abs logit error nan")."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megaloop.hf.errors import ConversionError
from megaloop.hf.validate import compare_logits


class _Fixed(torch.nn.Module):
    def __init__(self, value: float, hf: bool) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.value, self.hf = value, hf

    def forward(self, ids=None, depth=None, input_ids=None, **kw):
        x = ids if ids is not None else input_ids
        logits = torch.full((*x.shape, 8), self.value)
        return SimpleNamespace(logits=logits) if self.hf else logits


def test_non_finite_native_logits_are_named_as_a_diverged_checkpoint():
    with pytest.raises(ConversionError, match=r"the checkpoint's own logits are not finite at depth 3 \(a "
                                              r"diverged checkpoint\?"):
        compare_logits(_Fixed(float("nan"), False), _Fixed(0.0, True), depth=3, vocab=8, seq_len=4)
    res = compare_logits(_Fixed(1.0, False), _Fixed(1.0, True), depth=3, vocab=8, seq_len=4)
    assert res["max_abs"] == 0.0
