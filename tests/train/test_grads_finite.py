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


def test_the_end_of_run_warning():
    from megaloop.train.metrics import nonfinite_warning

    assert nonfinite_warning({"skipped_steps_total": 0}, 10, 0, {"val_ce": 3.0}) is None
    one = nonfinite_warning({"skipped_steps_total": 1}, 10, 0, {"val_ce": 3.0})
    assert one == "warning: 1 of the run's 10 steps were skipped as non-finite"  # no "diverging" for one old skip
    bad = nonfinite_warning({"skipped_steps_total": 2}, 10, 2, {"val_ce": float("nan")})
    assert bad.startswith("warning: 2 of the run's 10 steps were skipped as non-finite, the last 2 in a row; the "
                          "final validation CE is not finite: the run diverged or is diverging")
