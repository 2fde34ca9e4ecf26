"""TP=2/4 (with and without sequence parallelism) vs TP=1 for every injection and for QK-norm,
normalised injection input, tied embeddings, sandwich norms, readout C and QK biases, over gloo."""

import pytest

from tests.conftest import ROOT, run_torchrun

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("nproc", [2, 4])
def test_tp_matches_tp1(nproc):
    out = run_torchrun(ROOT / "tests/distributed/model_parallel_worker.py", nproc)
    assert "ALL OK" in out
    # 5 injections × layouts (tp=2 ±sp; with 4 ranks also tp=4 ±sp)
    assert out.count("OK ") >= (10 if nproc == 2 else 20)
    assert out.count("OK qk_norm+input_norm+tied+sandwich+readout") == (2 if nproc == 2 else 4)
    assert out.count("OK qk_bias ") == (2 if nproc == 2 else 4)
