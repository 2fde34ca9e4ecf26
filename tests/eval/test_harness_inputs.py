"""eval harness: what it reads and records (an audit of `megaloop eval harness`): every filter's metric kept,
the tasks' own files never written by --json, a missing data file or a bad --limit refused before the model
loads, task YAMLs that do not parse named, context / continuation split as lm-eval's causal models split it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from megaloop.config_utils import ConfigError
from megaloop.eval.harness import TASKS_DIR, MegaloopLM, check_task_inputs, resolve_tasks, run_harness

TWO_FILTERS = """task: two_filters
dataset_path: json
dataset_kwargs:
  data_files:
    test: data/qa.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{q}}"
doc_to_target: "{{a}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 3
  do_sample: false
metric_list:
  - metric: exact_match
filter_list:
  - name: strict
    filter:
      - function: regex
        regex_pattern: "NEVER([0-9])"
        fallback: "x"
      - function: take_first
  - name: loose
    filter:
      - function: regex
        regex_pattern: "(.*)"
      - function: take_first
"""


def _tasks(root: Path, data: bool = True) -> Path:
    (root / "data").mkdir(parents=True)
    (root / "two_filters.yaml").write_text(TWO_FILTERS)
    if data:
        (root / "data" / "qa.jsonl").write_text("".join(json.dumps({"q": f"Question {i}:", "a": "x"}) + "\n"
                                                        for i in range(3)))
    return root


@pytest.fixture
def no_load(monkeypatch):
    import megaloop.eval.cli as eval_cli

    monkeypatch.setattr(eval_cli, "build_engine", lambda *a, **k: pytest.fail("the model was loaded before the refusal"))


def test_every_filter_keeps_its_metric_and_the_json_records_versions(trained_engine, tmp_path):
    """lm-eval names a metric "metric,filter": cutting at the comma kept only the last filter's value (here
    the strict filter's 1.0 was lost when it came first). The record also names the task versions, n-shot,
    the seed, the batch size and lm-eval's version (it had none of them)."""
    tasks = _tasks(tmp_path / "tasks")
    res = run_harness(MegaloopLM(trained_engine, cache_mode="terminal", batch_size=2), ["two_filters"],
                      include_path=[tasks])
    m = res["results"]["two_filters"]
    assert m["exact_match,strict"] == 1.0  # the fallback "x" is every target
    assert 0.0 <= m["exact_match,loose"] <= 1.0 and "exact_match" not in m
    assert "two_filters" in res["versions"] and res["n_shot"]["two_filters"] == 0
    assert res["config"]["seed"] == 1234 and res["config"]["batch_size"] == 2
    assert res["lm_eval_version"].count(".") >= 1
    toy = run_harness(MegaloopLM(trained_engine, cache_mode="none"), ["megaloop_toy_mc"], limit=2)
    assert {"acc", "acc_norm"} <= set(toy["results"]["megaloop_toy_mc"])  # the plain filter "none" is dropped


def test_json_cannot_overwrite_what_the_tasks_read(cli, no_load, trained_run, tmp_path):
    tasks = _tasks(tmp_path / "tasks")
    base = ("eval", "harness", "--checkpoint", str(trained_run), "--tasks", "two_filters", "--include-path", str(tasks))
    for target, what in ((tasks / "two_filters.yaml", f"a file of the task folder {tasks}"),
                         (tasks / "data" / "qa.jsonl", "the data file of task two_filters"),
                         (TASKS_DIR / "results.json", f"a file of the task folder {TASKS_DIR}")):
        code, err = cli(*base, "--json", str(target))
        assert code == 2 and err == (f"megaloop: error: --json {target}: is {what}, which the tasks read; writing "
                                     "it would overwrite the command's own input, choose another path"), err
    assert (tasks / "two_filters.yaml").read_text() == TWO_FILTERS and not (TASKS_DIR / "results.json").exists()


def test_missing_data_bad_limit_and_broken_yaml_are_one_line_before_the_load(cli, no_load, trained_run, tmp_path):
    tasks = _tasks(tmp_path / "tasks", data=False)
    code, err = cli("eval", "harness", "--checkpoint", str(trained_run), "--tasks", "two_filters",
                    "--include-path", str(tasks))
    assert code == 2 and err == (f"megaloop: error: --tasks two_filters: its data file {tasks / 'data' / 'qa.jsonl'} "
                                 "does not exist (data_files of its YAML, relative to the YAML's folder)"), err
    for limit in ("inf", "nan", "1.5", "0"):  # inf: an OverflowError traceback after the load; 1.5: cut to 1
        code, err = cli("eval", "harness", "--checkpoint", str(trained_run), "--tasks", "megaloop_toy_mc",
                        "--limit", limit)
        assert code == 2 and err.startswith("megaloop: error: --limit: must be a whole number >= 1"), (limit, err)
    (tasks / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\n")
    code, err = cli("eval", "harness", "--checkpoint", str(trained_run), "--tasks", "broken",
                    "--include-path", str(tasks))
    assert code == 2 and "unknown task(s) ['broken']" in err and \
        f"task files that are not valid YAML: {tasks / 'broken.yaml'}: while parsing" in err, err


def test_a_merge_across_the_boundary_splits_as_lm_evals_causal_models(trained_engine):
    """Where BPE merges across the context / continuation boundary the continuation was encoded on its own
    (scores differed from `lm_eval --model hf` on the export); it is now the joint encoding's tail, as
    lm-eval's own TemplateLM._encode_pair makes it (the oracle here), except where that tail is empty (the
    context alone encodes to as many tokens as the whole), which lm-eval cannot score: the continuation's own
    encoding then."""
    from lm_eval.api.model import TemplateLM

    lm = MegaloopLM(trained_engine, cache_mode="none")
    oracle = SimpleNamespace(backend="causal", tok_encode=trained_engine.encode)
    text = "import os.path and the function definitions of the standard library module"
    merged = [(text[:i], text[i:]) for i in range(1, len(text) - 1) if text[i - 1] != " "
              and trained_engine.encode(text)[:len(trained_engine.encode(text[:i]))] != trained_engine.encode(text[:i])]
    assert merged, "no split point merges across the boundary with this tokenizer"
    differs = 0
    for ctx, cont in merged + [("import os", ".path"), ("Question: ", "pass")]:
        want = TemplateLM._encode_pair(oracle, ctx, cont)
        if not want[1]:
            want = (want[0], trained_engine.encode(cont))
        differs += want[1] != trained_engine.encode(cont)
        assert lm._encode_pair(ctx, cont) == want, (ctx, cont)
    assert differs  # splits where the tail is not the continuation's own encoding (the old fallback's)


def test_globbed_data_files_and_template_fields(trained_engine, tmp_path):
    """A `**` pattern matches files at any depth, as datasets reads it (it was refused); an output that the
    pattern would match is one of the task's data files (the next run would read it); a template field the
    data lacks is one line, not jinja's traceback."""
    tasks = _tasks(tmp_path / "tasks")
    (tasks / "two_filters.yaml").write_text(TWO_FILTERS.replace("data/qa.jsonl", "data/**/*.jsonl"))
    _, specs = resolve_tasks(["two_filters"], [tasks])
    check_task_inputs(specs, [tasks], {})
    with pytest.raises(ConfigError, match="is the data file of task two_filters"):
        check_task_inputs(specs, [tasks], {"--json": str(tasks / "data" / "new" / "results.jsonl")})
    (tasks / "two_filters.yaml").write_text(TWO_FILTERS.replace("{{q}}", "{{question}}"))
    with pytest.raises(ConfigError, match=r"^--tasks two_filters: a task's prompt template names a field its data "
                                          r"does not have \('question' is undefined\)$"):
        run_harness(MegaloopLM(trained_engine, cache_mode="none"), ["two_filters"], include_path=[tasks], limit=1)
