"""``megaloop eval ...`` and ``megaloop generate`` through the CLI entry point (in-process:
``megaloop.cli.main``, the console script's target; the process group stays up for other tests)."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def cli(megatron_world, monkeypatch, capsys):
    import megaloop.runtime.parallel as parallel
    from megaloop.cli import main

    monkeypatch.setattr(parallel, "destroy_distributed", lambda: None)  # keep the session's world

    def run(*argv: str) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as exit_info:
            main(list(argv))
        out = capsys.readouterr()
        return exit_info.value.code, out.out, out.err

    return run


def test_eval_commands_write_tables_and_json(cli, trained_run, tmp_path):
    ck = str(trained_run)
    code, out, _ = cli("eval", "ppl", "--checkpoint", ck, "--max-seqs", "2", "--json", str(tmp_path / "ppl.json"))
    assert code == 0 and "sharing penalty" in out and "terminal cache" in out
    res = json.loads((tmp_path / "ppl.json").read_text())
    assert res["num_seqs"] == 2 and res["terminal_ppl"] != res["per_visit_ppl"]
    assert res["engine"]["kv_bytes_per_token"]["terminal"] * 2 == res["engine"]["kv_bytes_per_token"]["per_visit"]

    code, out, _ = cli("eval", "sweep", "--checkpoint", ck, "--max-seqs", "1", "--depths", "1,4",
                       "--json", str(tmp_path / "sweep.json"))
    assert code == 0 and "extrapolation" in out and (tmp_path / "sweep.png").is_file()
    assert [r["depth"] for r in json.loads((tmp_path / "sweep.json").read_text())["rows"]] == [1, 4]

    code, out, _ = cli("eval", "fixed-point", "--checkpoint", ck, "--max-seqs", "1", "--prefix-len", "12",
                       "--json", str(tmp_path / "fp.json"))
    assert code == 0 and "spans qualified" in out
    fp = json.loads((tmp_path / "fp.json").read_text())
    assert fp["num_spans"] == 1 and fp["prefix_len"] == 12 and fp["criteria"]["max_steps"] == 1024

    code, out, _ = cli("eval", "harness", "--checkpoint", ck, "--tasks", "megaloop_toy_mc", "--limit", "6",
                       "--prefill-depth", "4", "--json", str(tmp_path / "h.json"))
    assert code == 0 and "acc" in out
    h = json.loads((tmp_path / "h.json").read_text())
    assert 0 <= h["results"]["megaloop_toy_mc"]["acc"] <= 1 and h["config"]["prefill_depth"] == 4


def test_generate_command(cli, trained_run, tmp_path):
    code, out, _ = cli("generate", "--checkpoint", str(trained_run), "--prompt", "The for statement",
                       "--prompt", "Classes", "--max-new-tokens", "5", "--prefill-depth", "6", "--decode-depth", "2",
                       "--json", str(tmp_path / "g.json"))
    assert code == 0 and out.startswith("The for statement") and "P=6, D=2" in out
    g = json.loads((tmp_path / "g.json").read_text())
    assert len(g["results"]) == 2 and all(len(r["token_ids"]) <= 5 for r in g["results"])
    assert g["stats"]["kv_bytes_per_token"] == g["stats"]["kv_bytes_per_token_terminal"]
    code, out, _ = cli("generate", "--checkpoint", str(trained_run), "--prompt", "x", "--temperature", "0.9",
                       "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "4", "--cache", "per_visit")
    assert code == 0 and "per_visit cache" in out


@pytest.mark.parametrize("argv, message", [
    (["generate", "--checkpoint", "{missing}", "--prompt", "x"], "checkpoint {missing} does not exist"),
    (["eval", "ppl", "--checkpoint", "{run}", "--depth", "0"], "--depth: recurrence depth must be an integer >= 1"),
    (["generate", "--checkpoint", "{run}", "--prompt", "word " * 200], "longer than the model's context of 128"),
    (["eval", "harness", "--checkpoint", "{run}", "--tasks", "nope"], "unknown task(s) ['nope']"),
    (["eval", "fixed-point", "--checkpoint", "{run}", "--max-steps", "2000"], "at most 1024 recurrences"),
    (["eval", "ppl", "--checkpoint", "{run}", "--data", "{missing}"], "--data: {missing} does not exist"),
])
def test_bad_inputs_exit_2_with_one_line(cli, trained_run, tmp_path, argv, message):
    fill = {"missing": str(tmp_path / "missing"), "run": str(trained_run)}
    code, _, err = cli(*[a.format(**fill) for a in argv])
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("megaloop: error")]
    assert len(lines) == 1 and message.format(**fill) in lines[0], err[-2000:]
