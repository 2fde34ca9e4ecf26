"""PP=2 and TP2×PP2 reproduce PP=1 losses over 3 steps of mixed depths (torchrun over gloo)."""

import pytest

from tests.train.helpers import metrics, run_train

pytestmark = pytest.mark.distributed
TOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("pp1")
    run_train(d, "train.max_steps=3", "train.save_interval=0")
    return metrics(d)


@pytest.mark.parametrize("layout,nproc", [(["parallel.pp=2"], 2),
                                          (["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"], 4)])
def test_pipeline_matches_pp1(tmp_path, reference, layout, nproc):
    run_train(tmp_path, "train.max_steps=3", "train.save_interval=0", *layout, nproc=nproc)
    got = metrics(tmp_path)
    assert [r["depths"] for r in got] == [r["depths"] for r in reference]
    assert len({d for r in got for d in r["depths"]}) > 1, "want a mix of depths"
    for a, b in zip(reference, got):
        assert abs(a["loss"] - b["loss"]) <= TOL * abs(a["loss"]), (a["step"], a["loss"], b["loss"])
        assert max(abs(x - y) for x, y in zip(a["prior_probs"], b["prior_probs"])) <= 1e-6
    # the checkpoint of the pipelined run is complete and written once per replica
    assert (tmp_path / "checkpoints" / "step_00000003" / "megaloop.json").is_file()
