"""grads_finite: the step's gradient checked on plain modules too (megatron's DDP keeps its grad buffers
in a ``buffers`` list, which shadows ``nn.Module.buffers``); the trainer's use is in test_nonfinite.py."""

import torch

from megaloop.train.grads import grads_finite


def test_plain_modules_and_non_finite_entries():
    m = torch.nn.Linear(3, 2)
    m(torch.randn(4, 3)).sum().backward()
    assert grads_finite([m])
    m.weight.grad[0, 0] = float("inf")
    assert not grads_finite([m])
    assert grads_finite([torch.nn.Linear(2, 2)])  # no gradient yet: nothing non-finite
