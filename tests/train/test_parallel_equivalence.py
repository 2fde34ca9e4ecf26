"""PP=2 and TP2×PP2 reproduce PP=1 losses over 3 steps of mixed depths (torchrun over gloo)."""

import pytest

from tests.train.helpers import metrics, run_train

pytestmark = pytest.mark.distributed
TOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("pp1")
    run_train(d, "train.max_steps=3", "train.save_interval=0", "train.micro_batch_size=2")  # 4 microbatches
    return metrics(d)


@pytest.mark.parametrize("layout,nproc", [(["parallel.pp=2"], 2),
                                          (["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"], 4),
                                          (["parallel.pp=4", "parallel.vpp=2"], 4)])  # interleaved 1F1B
def test_pipeline_matches_pp1(tmp_path, reference, layout, nproc):
    common = ["train.max_steps=3", "train.save_interval=0", "train.micro_batch_size=2", *layout]
    interleaved = "parallel.vpp=2" in layout
    # interleaved: stop at step 2 and resume (each rank holds two copies of the core: its load failed)
    run_train(tmp_path, *common, *(["train.stop_after=2"] if interleaved else []), nproc=nproc)
    if interleaved:
        run_train(tmp_path, *common, nproc=nproc, resume="auto")
    got = metrics(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert [r["depths"] for r in got] == [r["depths"] for r in reference]
    assert len({d for r in got for d in r["depths"]}) > 1, "want a mix of depths"
    for a, b in zip(reference, got):
        assert abs(a["loss"] - b["loss"]) <= TOL * abs(a["loss"]), (a["step"], a["loss"], b["loss"])
        assert max(abs(x - y) for x, y in zip(a["prior_probs"], b["prior_probs"])) <= 1e-6
    # the checkpoint of the pipelined run is complete and written once per replica
    assert (tmp_path / "checkpoints" / "step_00000003" / "megaloop.json").is_file()


def _prior_logits(run_dir):
    import torch

    common = torch.load(run_dir / "checkpoints" / "step_00000003" / "common.pt", weights_only=False)["common"]
    return torch.as_tensor(common["sampler"]["prior"]["logits"])


def _val_sources():
    from megaloop.data.loaders import read_sources

    return set(read_sources("default", seq_len=128))


def test_data_parallel_matches_single_replica(tmp_path):
    """DP=2 (micro-batch 2) vs DP=1 (micro-batch 4), same global batch and depths: same losses
    and the same prior logits after 3 steps (the prior sees the globally reduced CE)."""
    import torch

    one, two = tmp_path / "dp1", tmp_path / "dp2"
    common = ["train.max_steps=3", "train.save_interval=0", "train.global_batch_size=8"]
    run_train(one, *common, "train.micro_batch_size=4")
    run_train(two, *common, "train.micro_batch_size=2", nproc=2)
    a, b = metrics(one), metrics(two)
    assert [r["depths"] for r in a] == [r["depths"] for r in b]
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= TOL * abs(x["loss"]), (x["step"], x["loss"], y["loss"])
    # MixVal: the same source-balanced validation sequences at both layouts, every source scored
    va, vb = a[-1], b[-1]
    assert va["val_sequences"] == vb["val_sequences"] == 8  # eval_batches=1 × global batch 8
    assert abs(va["val_ce"] - vb["val_ce"]) <= TOL * va["val_ce"]
    assert set(va["val_ce_per_source"]) == set(vb["val_ce_per_source"]) == set(_val_sources())
    for src, ce in va["val_ce_per_source"].items():
        assert abs(ce - vb["val_ce_per_source"][src]) <= TOL * ce
    la, lb = _prior_logits(one), _prior_logits(two)
    assert torch.allclose(la, lb, rtol=0, atol=1e-6)
    assert not torch.equal(la, torch.zeros_like(la))


def test_resume_across_layouts(tmp_path):
    """A checkpoint written at TP=2 (+SP) resumes at PP=2: megatron's distributed checkpoints
    (layout-independent keys, fully reshardable optimizer state) need no resharding step."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    common = ["train.max_steps=5", "train.save_interval=0"]
    run_train(ref, *common)
    run_train(run, *common, "parallel.tp=2", "parallel.sequence_parallel=true", "train.stop_after=3", nproc=2)
    run_train(run, *common, "parallel.pp=2", nproc=2, resume="auto")
    a, b = metrics(ref), metrics(run)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    for x, y in zip(a, b):
        assert x["depths"] == y["depths"]
        assert abs(x["loss"] - y["loss"]) <= TOL * abs(x["loss"]), (x["step"], x["loss"], y["loss"])
    # train.init_weights from the TP=2+SP checkpoint: fresh runs at TP=1 (resharded) and TP=2 start from
    # the same weights, so their first losses (before any update) agree, and they are a trained model's
    tp2_step3 = run / "checkpoints" / "step_00000003"
    assert (tp2_step3 / "megaloop.json").is_file()
    fresh = ["train.max_steps=2", "train.stop_after=1", "train.save_interval=0", f"train.init_weights={tp2_step3}"]
    run_train(tmp_path / "init_tp1", *fresh)
    run_train(tmp_path / "init_tp2", *fresh, "parallel.tp=2", nproc=2)
    x, y = metrics(tmp_path / "init_tp1")[0], metrics(tmp_path / "init_tp2")[0]
    assert x["depths"] == y["depths"] == a[0]["depths"]  # a fresh sampler: step 1's draws
    assert abs(x["loss"] - y["loss"]) <= TOL * abs(x["loss"]), (x["loss"], y["loss"])
    assert x["loss"] < a[0]["loss"] - 0.5, (x["loss"], a[0]["loss"])  # not a fresh init's loss


def test_tied_embedding_at_pp2_resumes_exactly(tmp_path):
    """megatron-core 0.16.1 saved the distributed optimizer's state of a parameter after a padded
    bucket end shifted (megaloop/train/optim_layout.py); a tied embedding at PP>1 has a bucket of its
    own, and with GQA + QK biases the bucket before it ends 64 elements short of the padding multiple:
    a resume at PP=2 continued ~1 nat above the uninterrupted run, silently. Now it is the same run."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    trio = ["model.tie_embeddings=true", "model.num_query_groups=2", "model.qk_bias=true"]
    common = ["train.max_steps=4", "train.save_interval=0", "train.micro_batch_size=2", *trio]
    run_train(ref, *common)  # PP=1 (the pipeline equals it to TOL, test_pipeline_matches_pp1)
    out = run_train(run, *common, "parallel.pp=2", "train.stop_after=2", nproc=2)
    assert "exceeds unpadded buffer" not in out.stdout + out.stderr
    run_train(run, *common, "parallel.pp=2", nproc=2, resume="auto")
    a, b = metrics(ref), metrics(run)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        assert x["depths"] == y["depths"]
        assert abs(x["loss"] - y["loss"]) <= TOL * abs(x["loss"]), (x["step"], x["loss"], y["loss"])
