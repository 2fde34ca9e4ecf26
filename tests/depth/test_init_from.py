"""depth.init=from:PATH (another run's learned prior, frozen or not) and depth.correlation=step
in real training runs: the distributions start where the source ended, and both resume exactly."""

import pytest

from tests.train.helpers import metrics, run_train

STEPS = ["train.max_steps=4", "train.save_interval=0", "depth.warmup_updates=0", "depth.lr=0.05"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A learned-prior run whose final distribution differs from its PLN init."""
    d = tmp_path_factory.mktemp("source")
    run_train(d, *STEPS)
    recs = metrics(d)
    assert recs[-1]["prior_probs"] != recs[0]["prior_probs"]
    return d, recs[-1]["prior_probs"]


def test_frozen_from_another_run_keeps_its_final_distribution(tmp_path, source):
    src, final = source
    over = [*STEPS, f"depth.init=from:{src}", "depth.frozen=true"]
    run_train(tmp_path, *over, "train.stop_after=2")
    run_train(tmp_path, *over, resume="auto")
    recs = metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:  # frozen: the source's final probabilities at every step, across the resume
        assert max(abs(a - b) for a, b in zip(r["prior_probs"], final)) <= 1e-6


def test_learning_from_another_run_with_step_correlation_resumes_exactly(tmp_path, source):
    src, final = source
    over = [*STEPS, f"depth.init=from:{src}", "depth.correlation=step", "train.micro_batch_size=2"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run_train(full, *over)
    run_train(cut, *over, "train.stop_after=2")
    run_train(cut, *over, resume="auto")
    a, b = metrics(full), metrics(cut)
    keys = ("step", "loss", "depths", "prior_probs", "model_flops_total", "depth_counts")
    assert [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b]
    assert all(len(set(r["depths"])) == 1 and len(r["depths"]) == 4 for r in a)  # one depth per step
    # it starts from the source's distribution (its first update moves it) and keeps learning
    assert a[-1]["prior_probs"] != final


def test_bad_init_from_exits_2_naming_the_option(tmp_path):
    missing = tmp_path / "nowhere"
    proc = run_train(tmp_path / "a", f"depth.init=from:{missing}", expect=2)
    assert f"depth.init=from:{missing}" in proc.stderr and "no such" in proc.stderr
    pln = tmp_path / "pln"
    run_train(pln, "train.max_steps=2", "train.save_interval=0", "depth.kind=pln")
    proc = run_train(tmp_path / "b", f"depth.init=from:{pln}", expect=2)
    assert f"depth.init=from:{pln}" in proc.stderr and "no learned prior" in proc.stderr
    proc = run_train(tmp_path / "c", "depth.correlation=rank", expect=2)
    assert "depth.correlation" in proc.stderr
    assert not (tmp_path / "b" / "checkpoints").exists()


def test_a_target_mean_outside_the_source_priors_support_is_refused():
    """init=from:PATH starts from the other run's support; a target mean outside it was accepted."""
    import torch

    from megaloop.config import load_config
    from megaloop.config_utils import ConfigError
    from megaloop.depth.prior import LearnedDepthPrior

    cfg = load_config("tiny", ["depth.init=from:/elsewhere", "depth.target_mean=12"]).depth
    active = torch.zeros(cfg.r_max, dtype=torch.bool)
    active[:10] = True
    state = {"active": active, "logits": torch.zeros(cfg.r_max, dtype=torch.float64)}
    with pytest.raises(ConfigError, match=r"^depth\.target_mean: 12 is outside the support 1\.\.10 that "
                                          r"from:/elsewhere starts from"):
        LearnedDepthPrior(cfg, state)
    cfg.target_mean = 9.5
    assert LearnedDepthPrior(cfg, state).probs()[10:].sum() == 0


def test_plan_starts_from_the_source_prior(capsys, source):
    """`megaloop plan` planned a uniform law for depth.init=from:PATH (and accepted a PATH that did
    not exist): it now reads PATH's prior as training does."""
    import json

    from megaloop.plan.cli import main as plan_main

    src, final = source
    assert plan_main(["--config", "tiny", "--gpus", "1", "--steps", "1", "--json", f"depth.init=from:{src}"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert abs(rep["mean_depth"] - sum((i + 1) * p for i, p in enumerate(final))) < 1e-4  # metrics round probs
    assert plan_main(["--config", "tiny", "--gpus", "1", "--preflight", f"depth.init=from:{src / 'nowhere'}"]) == 2
    assert f"depth.init=from:{src / 'nowhere'}: no such run directory" in capsys.readouterr().err
