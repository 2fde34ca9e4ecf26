"""lm-eval adapter: the shipped multiple-choice task end to end (offline), scoring modes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megaloop.config_utils import ConfigError
from megaloop.eval.harness import MegaloopLM, resolve_tasks, run_harness


def _req(*args):
    return SimpleNamespace(args=args)


def test_local_multiple_choice_task_end_to_end(trained_engine):
    res = run_harness(MegaloopLM(trained_engine, cache_mode="terminal"), ["megaloop_toy_mc"])
    m = res["results"]["megaloop_toy_mc"]
    assert 0.0 <= m["acc"] <= 1.0 and 0.0 <= m["acc_norm"] <= 1.0 and m["sample_len"] == 24
    assert res["config"]["cache_mode"] == "terminal" and res["config"]["depth"] == trained_engine.depth
    assert res["config"]["scoring"] == "decode"  # the paper's protocol is the default


def test_scoring_modes(trained_engine):
    reqs = [_req("Question: Which statement does nothing?\nAnswer:", " pass"),
            _req("Question: Which statement does nothing?\nAnswer:", " break the loop"),
            _req("", "The for statement"), _req("Classes ", "provide a means")]
    full = MegaloopLM(trained_engine, cache_mode="none").loglikelihood(reqs)
    per_visit = MegaloopLM(trained_engine, cache_mode="per_visit").loglikelihood(reqs)
    terminal = MegaloopLM(trained_engine, cache_mode="terminal").loglikelihood(reqs)
    for (a, ga), (b, gb) in zip(full, per_visit):  # per-visit cache at P == R = parallel forward
        assert a == pytest.approx(b, abs=1e-3) and ga == gb
    assert all(math.isfinite(x) and x < 0 for x, _ in terminal)
    assert terminal[1][0] != pytest.approx(full[1][0], abs=1e-6)  # multi-token continuation: sharing differs
    # manual check of the parallel-forward score of one request
    ctx = trained_engine.encode("Classes")
    cont = trained_engine.encode("Classes provide a means")[len(ctx):]
    logits = trained_engine.forward(torch.tensor([ctx + cont[:-1]]))[0, len(ctx) - 1:, :trained_engine.vocab_size]
    manual = torch.log_softmax(logits, -1).gather(-1, torch.tensor(cont)[:, None]).sum().item()
    assert full[3][0] == pytest.approx(manual, abs=1e-3)
    # rolling log-likelihood: EOS-conditioned sum over the text
    lm = MegaloopLM(trained_engine, cache_mode="none")
    roll = lm.loglikelihood_rolling([_req("The for statement is used")])[0]
    assert roll == pytest.approx(lm.loglikelihood([_req("", "The for statement is used")])[0][0], abs=1e-3)
    out = lm.generate_until([_req("The for statement", {"until": ["\n"], "max_gen_toks": 5})])
    assert isinstance(out[0], str) and "\n" not in out[0]


def test_unknown_tasks_and_modes():
    with pytest.raises(ConfigError, match=r"unknown task\(s\) \['no_such_task'\]; local tasks: \[.*'megaloop_toy_mc'.*\]"):
        resolve_tasks(["no_such_task"])
    manager, specs = resolve_tasks(["megaloop_toy_mc"])
    assert specs == ["megaloop_toy_mc"] and "megaloop_toy_mc" in manager.all_tasks  # loaded by lm-eval itself


def test_plain_include_path_yaml_gets_absolute_data_files(tmp_path):
    from megaloop.eval.harness import TASKS_DIR

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mc.jsonl").write_text((TASKS_DIR / "megaloop_toy_mc.jsonl").read_text())
    text = (TASKS_DIR / "megaloop_toy_mc.yaml").read_text()
    text = text.replace("task: megaloop_toy_mc", "task: my_mc").replace("megaloop_toy_mc.jsonl", "data/mc.jsonl")
    (tmp_path / "my_mc.yaml").write_text("\n".join(l for l in text.splitlines() if "custom_dataset" not in l))
    _, specs = resolve_tasks(["my_mc"], [tmp_path])
    assert specs[0]["dataset_kwargs"]["data_files"]["test"] == str(tmp_path / "data" / "mc.jsonl")


def test_bad_lm_arguments(trained_engine):
    with pytest.raises(ConfigError, match="--cache"):
        MegaloopLM(trained_engine, cache_mode="full")
    with pytest.raises(ConfigError, match="--depth"):
        MegaloopLM(trained_engine, depth=0)


def test_no_git_message_outside_a_checkout(trained_engine, tmp_path, monkeypatch, capfd):
    """lm-eval asks git for the working directory's commit; outside a checkout git printed
    "fatal: not a git repository" on stderr. The record stays (None there), the message goes."""
    import lm_eval.evaluator as evaluator

    original = evaluator.get_git_commit_hash
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    capfd.readouterr()
    run_harness(MegaloopLM(trained_engine, cache_mode="terminal"), ["megaloop_toy_mc"], limit=2)
    assert "fatal" not in capfd.readouterr().err
    assert evaluator.get_git_commit_hash is original


def test_model_args_and_lm_eval_options_are_honoured(megatron_world, trained_run):
    """lm-eval's API path: `cache_mode=none` became Python None ("--cache: ... got None"), a bad batch_size
    was replaced by 16 in silence, and simple_evaluate(device=...) was dropped while the results named it."""
    lm = MegaloopLM.create_from_arg_string(f"checkpoint={trained_run},cache_mode=none", {"device": "cpu"})
    assert lm.cache_mode == "none" and lm.scoring == "parallel" and str(lm.engine.device) == "cpu"
    assert MegaloopLM.create_from_arg_string(f"checkpoint={trained_run}", {"batch_size": "auto"}).batch_size == 16
    for bad in ("0", "-3", "x"):
        with pytest.raises(ConfigError, match=r"--batch-size: must be an integer >= 1"):
            MegaloopLM.create_from_arg_string(f"checkpoint={trained_run},batch_size={bad}")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--device cuda:0: CUDA is not available"):
            MegaloopLM.create_from_arg_string(f"checkpoint={trained_run}", {"device": "cuda:0"})
    with pytest.raises(ConfigError, match=r"device=cpu in model_args and device=cuda from lm-eval's --device"):
        MegaloopLM.create_from_arg_string(f"checkpoint={trained_run},device=cpu", {"device": "cuda"})
