"""``megaloop eval ...`` and ``megaloop generate`` through the CLI entry point (in-process:
``megaloop.cli.main``, the console script's target; the process group stays up for other tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TEXT = Path(__file__).parent / "data" / "looped_models.txt"


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


def test_eval_commands_write_tables_and_json(cli, trained_run, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # rich wraps the tables' headers at 80
    ck = str(trained_run)
    code, out, err = cli("eval", "ppl", "--checkpoint", ck, "--max-seqs", "2", "--json", str(tmp_path / "ppl.json"))
    assert code == 0 and "sharing penalty" in out and "terminal cache" in out
    res = json.loads((tmp_path / "ppl.json").read_text())
    # which step a folder resolved to (a run training there saves newer ones; it was in --json only)
    assert f"checkpoint: {res['engine']['source']['path']} (step 30, the newest in {ck})" in err, err
    assert res["num_seqs"] == 2 and res["terminal_ppl"] != res["per_visit_ppl"]
    assert (res["seq_len"], res["prefix_len"], res["rope_extrapolated"]) == (128, 64, False)
    assert res["engine"]["kv_bytes_per_token"]["terminal"] * 2 == res["engine"]["kv_bytes_per_token"]["per_visit"]

    code, out, _ = cli("eval", "sweep", "--checkpoint", ck, "--max-seqs", "1", "--depths", "1,4", "--sharing",
                       "--prefix-len", "32", "--json", str(tmp_path / "sweep.json"))
    assert code == 0 and "\nextrapolation: PPL(R=4) / PPL(R=3)" in out and (tmp_path / "sweep.png").is_file()
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["depth"] for r in sweep["rows"]] == [1, 4] and sweep["prefix_len"] == 32
    # the native column is over every position, the caches' over the positions after the prefix: the table and
    # JSON give the native PPL of those too (at R=1 per-visit is the plain forward: a 25 % "gain" showed)
    assert "native PPL (all)" in out and "native (2nd half)" in out, out
    r1 = sweep["rows"][0]
    assert r1["native_ppl_second_half"] != r1["native_ppl"]
    assert abs(r1["native_ppl_second_half"] / r1["per_visit_ppl"] - 1) < 1e-4, r1
    assert (sweep["seq_len"], sweep["training_seq_len"], sweep["rope_extrapolated"]) == (128, 128, False)
    code, out, err = cli("eval", "sweep", "--checkpoint", ck, "--max-seqs", "1", "--depths", "1", "--seq-len", "160",
                         "--json", str(tmp_path / "s160.json"), "--plot", str(tmp_path / "s160.png"))
    long = json.loads((tmp_path / "s160.json").read_text())
    assert code == 0 and (long["seq_len"], long["rope_extrapolated"]) == (160, True) and "extrapolated" in err
    # a sweep that stops below the reference depth is not an extrapolation (it was printed as one)
    assert "no extrapolation (the deepest swept R=1 is not past the reference R=3): PPL(R=1)" in out, out

    code, out, _ = cli("eval", "fixed-point", "--checkpoint", ck, "--max-seqs", "1", "--prefix-len", "12",
                       "--json", str(tmp_path / "fp.json"))
    assert code == 0 and "spans qualified" in out
    # the per-source title said "16 spans per source" beside one span in all
    assert "Fixed points per source (up to 16 spans per source, 1 in all by --max-seqs 1)" in out, out
    fp = json.loads((tmp_path / "fp.json").read_text())
    assert fp["num_spans"] == 1 and fp["prefix_len"] == 12 and fp["criteria"]["max_steps"] == 1024

    code, out, _ = cli("eval", "harness", "--checkpoint", ck, "--tasks", "megaloop_toy_mc", "--limit", "6",
                       "--prefill-depth", "4", "--json", str(tmp_path / "h.json"))
    assert code == 0 and "acc" in out
    h = json.loads((tmp_path / "h.json").read_text())
    assert 0 <= h["results"]["megaloop_toy_mc"]["acc"] <= 1 and h["config"]["prefill_depth"] == 4


def test_eval_copying_command(cli, trained_run, tmp_path):
    from megaloop.eval.copying import copy_probe
    from megaloop.hf.load import load_model

    code, out, _ = cli("eval", "copying", "--checkpoint", str(trained_run), "--num-seqs", "3", "--half-len", "20",
                       "--json", str(tmp_path / "copy.json"))
    assert code == 0 and "copy gain" in out
    res = json.loads((tmp_path / "copy.json").read_text())
    # default depths: 1 and the run's eval depth (tiny: 3); special ids (EOS, BOS, pad) left out
    assert sorted(res["depths"]) == ["1", "3"] and res["half_len"] == 20 and res["excluded_ids"] == [0, 1, 2]
    hf = load_model(trained_run).model.eval()
    want = copy_probe(lambda i: hf(input_ids=i, num_recurrences=3).logits, 4096, num_seqs=3, half_len=20,
                      exclude=[0, 1, 2])
    assert res["depths"]["3"]["copy_gain"] == pytest.approx(want["copy_gain"], abs=1e-4)


def test_generate_command(cli, trained_run, tmp_path):
    code, out, _ = cli("generate", "--checkpoint", str(trained_run), "--prompt", "The for statement",
                       "--prompt", "Classes", "--max-new-tokens", "5", "--prefill-depth", "6", "--decode-depth", "2",
                       "--json", str(tmp_path / "g.json"))
    assert code == 0 and out.startswith("The for statement") and "P=6, D=2" in out
    g = json.loads((tmp_path / "g.json").read_text())
    assert len(g["results"]) == 2 and all(len(r["token_ids"]) <= 5 for r in g["results"])
    assert g["stats"]["kv_bytes_per_token"] == g["stats"]["kv_bytes_per_token_terminal"]
    code, out, err = cli("generate", "--checkpoint", str(trained_run), "--prompt", "x", "--temperature", "0.9",
                         "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "4", "--cache", "per_visit")
    assert code == 0 and "per_visit cache" in out and "extrapolated" not in err
    # past the training length (128) with --max-context: said once on stderr and in the JSON
    code, out, err = cli("generate", "--checkpoint", str(trained_run), "--prompt", "word " * 140, "--max-context",
                         "256", "--max-new-tokens", "2", "--ignore-eos", "--json", str(tmp_path / "long.json"))
    long = json.loads((tmp_path / "long.json").read_text())
    assert code == 0 and len(long["results"][0]["token_ids"]) == 2
    fed = long["stats"]["prompt_tokens"] + 1  # the prompt and the first generated token
    assert fed > 128 and long["rope_extrapolated"] is True
    assert err.count(f"RoPE positions 128..{fed - 1} were never trained and are extrapolated") == 1, err
    assert json.loads((tmp_path / "g.json").read_text())["rope_extrapolated"] is False


@pytest.mark.parametrize("argv, message", [
    (["generate", "--checkpoint", "{missing}", "--prompt", "x"], "checkpoint {missing} does not exist"),
    (["eval", "ppl", "--checkpoint", "{run}", "--depth", "0"], "--depth: recurrence depth must be an integer >= 1"),
    (["generate", "--checkpoint", "{run}", "--prompt", "word " * 200], "longer than the model's context of 128"),
    (["eval", "harness", "--checkpoint", "{run}", "--tasks", "nope"], "unknown task(s) ['nope']"),
    (["eval", "fixed-point", "--checkpoint", "{run}", "--max-steps", "2000"], "at most 1024 recurrences"),
    (["eval", "ppl", "--checkpoint", "{run}", "--data", "{missing}"], "--data: {missing} does not exist"),
    (["eval", "ppl", "--checkpoint", "{run}", "--data", "{short}"], "--data: {short} tokenises to"),
    (["eval", "ppl", "--checkpoint", "{run}", "--data", "{text}", "--prefix-len", "128"],
     "--prefix-len: must be in [1, 126] for 128-token sequences"),
    (["eval", "fixed-point", "--checkpoint", "{run}", "--data", "{text}", "--per-source", "4"],
     "--per-source: {text} has no 'source' column"),
    (["eval", "harness", "--checkpoint", "{run}", "--tasks", "megaloop_toy_mc", "--cache", "none", "--scoring",
      "decode"], "--scoring decode: token-by-token decoding needs a KV cache"),
    (["eval", "sweep", "--checkpoint", "{run}", "--exit", "latent:1e-3"], "--exit: applies to the prefill/decode "
     "protocols of --sharing"),
    (["eval", "sweep", "--checkpoint", "{run}", "--prefill-depth", "3"], "--prefill-depth: applies to"),
    (["eval", "sweep", "--checkpoint", "{run}", "--prefix-len", "32"], "--prefix-len: applies to the prefill/decode"),
    (["eval", "sweep", "--checkpoint", "{run}", "--sharing", "--decode-depth", "3"],
     "--decode-depth: eval sweep decodes each row at its own depth"),
    # cheap options are checked before the checkpoint (here missing) is even looked at
    (["generate", "--checkpoint", "{missing}", "--prompt", "x", "--exit", "foo:1"], "--exit:"),
    (["eval", "fixed-point", "--checkpoint", "{run}", "--depth", "99"],
     "--depth: eval fixed-point iterates each span to its fixed point"),
    (["eval", "fixed-point", "--checkpoint", "{run}", "--dtype", "bf16"], "--dtype bf16: eval fixed-point solves in FP32"),
    (["eval", "copying", "--checkpoint", "{run}", "--depths", ""], "--depths"),
    (["generate", "--checkpoint", "{missing}", "--prompt", "x", "--max-depth", "8"],
     "--max-depth: applies to adaptive depth; add --exit"),
    (["eval", "ppl", "--checkpoint", "{missing}", "--min-depth", "2"], "--min-depth: applies to adaptive depth"),
    (["generate", "--checkpoint", "{missing}", "--prompt", "x", "--top-k", "5"],
     "--top-k: applies to sampling; add --temperature T"),
    (["generate", "--checkpoint", "{missing}", "--prompt", "x", "--greedy", "--seed", "3"],
     "--seed: applies to sampling"),
    (["generate", "--checkpoint", "{missing}", "--prompt", "x", "--student", "{missing}", "--cache", "per_visit"],
     "--student: the student's prefill fills a terminal cache; with --cache per_visit it would never run"),
    (["generate", "--checkpoint", "{missing}", "--prompt", "x", "--student", "{missing}", "--prefill-depth", "8"],
     "--prefill-depth: with --student the prompt is prefilled by the student"),  # it was ignored, and reported
    (["eval", "ppl", "--checkpoint", "{missing}", "--student", "{missing}", "--prefill-depth", "2"],
     "--prefill-depth: with --student the prompt is prefilled by the student"),
    (["eval", "harness", "--checkpoint", "{missing}", "--tasks", "megaloop_toy_mc", "--student", "{missing}",
      "--cache", "none"],
     "--student: the student's prefill fills a terminal cache; with --cache none"),
    (["generate", "--checkpoint", "{missing}", "--prompt", "x", "--exit", "latent:1e-3", "--max-depth", "2",
      "--decode-depth", "6"], "--max-depth: 2 is below --decode-depth 6"),
    (["generate", "--checkpoint", "{missing}", "--prompt", "x", "--tokenizer", "{missing}/t.json"],
     "--tokenizer {missing}/t.json: no such file or directory"),
    (["eval", "ppl", "--checkpoint", "{missing}", "--json", "{short}/out.json"],
     "--json {short}/out.json: {short} is a file, so the path cannot be created"),
    (["eval", "sweep", "--checkpoint", "{missing}", "--data", "{missing}.txt"], "--data: {missing}.txt does not exist"),
    (["eval", "states", "--checkpoint", "{missing}", "--data", "{bin}"], "--data: {bin} is a file of no known text "
     "format"),
    (["eval", "ppl", "--checkpoint", "{run}", "--data", "{empty}"], "--data: {empty} is empty: nothing to evaluate"),
    (["eval", "copying", "--checkpoint", "{missing}", "--depths", "1,x"], "--depths: 'x' is not an integer"),
    (["eval", "copying", "--checkpoint", "{missing}", "--depths", "0,5"], "--depths: recurrence depth must be an integer >= 1, got 0"),
    (["eval", "copying", "--checkpoint", "{missing}", "--half-len", "1"], "--half-len: must be >= 2"),
    (["eval", "copying", "--checkpoint", "{run}", "--half-len", "65"], "--half-len: 65 random tokens twice (130) "
     "exceed the context 128"),
    (["eval", "ppl", "--checkpoint", "{run}", "--data", "{blank}"], "--data: {blank} holds only whitespace"),
])
def test_bad_inputs_exit_2_with_one_line(cli, trained_run, tmp_path, argv, message):
    (tmp_path / "short.txt").write_text("A few words only.")
    (tmp_path / "shard.bin").write_bytes(b"\x00\x01")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": "  "}\n\n{"text": ""}\n')
    fill = {"missing": str(tmp_path / "missing"), "run": str(trained_run), "short": str(tmp_path / "short.txt"),
            "text": str(TEXT), "bin": str(tmp_path / "shard.bin"), "empty": str(tmp_path / "empty.txt"),
            "blank": str(tmp_path / "blank.jsonl")}
    code, _, err = cli(*[a.format(**fill) for a in argv])
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("megaloop: error")]
    assert len(lines) == 1 and message.format(**fill) in lines[0], err[-2000:]


def test_ppl_and_sweep_refuse_a_batch_memory_cannot_hold_before_any_forward(cli, trained_run, monkeypatch):
    import megaloop.eval.ppl as ppl

    def forbidden(*a, **k):
        raise AssertionError("evaluate_ppl ran although the memory check should have refused")

    monkeypatch.setattr(ppl, "evaluate_ppl", forbidden)
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", str(20 << 20))  # 20 MiB free: less than 4 × 128 tokens of logits
    code, _, err = cli("eval", "ppl", "--checkpoint", str(trained_run), "--max-seqs", "4")
    assert code == 2 and "megaloop: error: --batch-size 4 × --seq-len 128: the native pass needs an estimated" in err
    assert "--batch-size 3 fits" in err and "of the 20.0 MiB available" in err, err
    code, _, err = cli("eval", "sweep", "--checkpoint", str(trained_run), "--max-seqs", "4", "--depths", "1,64",
                       "--sharing")
    assert code == 2 and "--batch-size 4 × --seq-len 128: the per_visit pass" in err, err
    code, _, err = cli("eval", "states", "--checkpoint", str(trained_run), "--depth", "64")
    assert code == 2 and "--max-seqs 16 × --seq-len 128 at --depth 64: the state trace needs" in err, err
    # --no-memory-check skips it: the (forbidden) evaluation is reached
    with pytest.raises(AssertionError, match="memory check should have refused"):
        cli("eval", "ppl", "--checkpoint", str(trained_run), "--max-seqs", "4", "--no-memory-check")


def test_generate_and_harness_refuse_what_memory_cannot_hold_before_any_forward(cli, trained_run, monkeypatch):
    from megaloop.eval import decode_score
    from megaloop.inference.engine import InferenceEngine

    def forbidden(*a, **k):
        raise AssertionError("ran although the memory check should have refused")

    monkeypatch.setattr(InferenceEngine, "generate", forbidden)
    monkeypatch.setattr(decode_score, "decode_loglikelihood", forbidden)
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", str(4 << 20))  # 4 MiB: less than 128 tokens' per-visit banks at R=64
    ck = str(trained_run)
    code, _, err = cli("generate", "--checkpoint", ck, "--prompt", "The", "--prompt", "A looped", "--cache",
                       "per_visit", "--decode-depth", "64", "--max-new-tokens", "500")
    # the shorter prompt is left-padded and runs to the 128-token context: 128 + the padding positions
    assert code == 2 and "megaloop: error: 2 prompt(s) of up to 3 tokens + --max-new-tokens 500 (130 tokens " \
        "held per row, per_visit cache at depth 64): the decode phase needs an estimated" in err, err
    code, _, err = cli("eval", "harness", "--checkpoint", ck, "--tasks", "megaloop_toy_mc", "--limit", "4",
                       "--cache", "per_visit", "--decode-depth", "64", "--batch-size", "64")
    assert code == 2 and "megaloop: error: --batch-size " in err and "per_visit cache at depth 64" in err, err
    assert "use --cache terminal" in err
    # on a terminal cache the advice does not suggest the cache already in use
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", str(1 << 16))
    for argv in (["generate", "--prompt", "The", "--cache", "terminal", "--decode-depth", "64"],
                 ["eval", "harness", "--tasks", "megaloop_toy_mc", "--limit", "4", "--cache", "terminal",
                  "--decode-depth", "64"]):
        code, _, err = cli(*argv, "--checkpoint", ck)
        assert code == 2 and "terminal cache" in err and "use --cache terminal" not in err, (argv, err)
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", str(4 << 20))
    for argv in (["generate", "--prompt", "The", "--cache", "per_visit", "--decode-depth", "64"],
                 ["eval", "harness", "--tasks", "megaloop_toy_mc", "--limit", "4", "--cache", "per_visit",
                  "--decode-depth", "64"]):
        with pytest.raises(AssertionError, match="memory check should have refused"):
            cli(*argv, "--checkpoint", ck, "--no-memory-check")


def test_copying_fixed_point_and_synth_refuse_what_memory_cannot_hold_before_any_forward(cli, trained_run,
                                                                                           monkeypatch):
    from megaloop.eval import copying, decode_score
    from megaloop.inference import fixed_point

    def forbidden(*a, **k):
        raise AssertionError("ran although the memory check should have refused")

    for mod, name in ((copying, "copy_probe"), (fixed_point, "fixed_point_report"),
                      (decode_score, "decode_loglikelihood"), (decode_score, "parallel_loglikelihood")):
        monkeypatch.setattr(mod, name, forbidden)
    ck = str(trained_run)
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", str(20 << 20))  # 20 MiB: less than 16 × 128 tokens of logits
    code, _, err = cli("eval", "copying", "--checkpoint", ck)
    assert code == 2 and "megaloop: error: --num-seqs 16 × 2 · --half-len 64 tokens: the probe's forward" in err, err
    assert "--num-seqs 2 fits" in err, err
    monkeypatch.setenv("MEGALOOP_EVAL_MEMORY", str(4 << 20))  # 4 MiB: less than a 128-token span's solve (4.8 MiB)
    code, _, err = cli("eval", "fixed-point", "--checkpoint", ck, "--max-seqs", "1")
    assert code == 2 and "megaloop: error: --prefix-len 127: one span's fixed-point solve" in err, err
    assert "--prefix-len 98 fits" in err, err
    code, _, err = cli("eval", "synth", "--checkpoint", ck, "--cache", "per_visit", "--depths", "1,64", "--ks", "1")
    assert code == 2 and "megaloop: error: --batch-size " in err and "per_visit cache at depth 64" in err, err
    for argv in (["eval", "copying"], ["eval", "fixed-point", "--max-seqs", "1"],
                 ["eval", "synth", "--cache", "per_visit", "--depths", "1,64", "--ks", "1"]):
        with pytest.raises(AssertionError, match="memory check should have refused"):
            cli(*argv, "--checkpoint", ck, "--no-memory-check")


def test_ppl_on_a_text_file_at_an_explicit_protocol_length(cli, trained_run, tmp_path):
    out = tmp_path / "ppl.json"
    code, stdout, err = cli("eval", "ppl", "--checkpoint", str(trained_run), "--data", str(TEXT), "--seq-len", "256",
                            "--prefix-len", "64", "--json", str(out))
    assert code == 0 and "first 64 prefilled" in stdout
    res = json.loads(out.read_text())
    lengths = (res["seq_len"], res["prefix_len"], res["training_seq_len"], res["rope_extrapolated"])
    assert lengths == (256, 64, 128, True)
    assert res["num_seqs"] >= 2 and res["tokens_scored"] == res["num_seqs"] * (256 - 64 - 1)
    assert res["data"] == str(TEXT) and res["terminal_ppl"] > 1
    assert err.count("RoPE positions 128..255 were never trained and are extrapolated") == 1


def test_fixed_point_spans_per_source(cli, trained_run, tmp_path):
    from megaloop.eval.ppl import load_eval_data

    out = tmp_path / "fp.json"
    code, stdout, _ = cli("eval", "fixed-point", "--checkpoint", str(trained_run), "--per-source", "2",
                          "--prefix-len", "8", "--control-depth", "0", "--no-zero-init", "--json", str(out))
    assert code == 0 and "per source" in stdout
    fp = json.loads(out.read_text())
    names = list(dict.fromkeys(load_eval_data("default", default_seq_len=128).sources))  # the set's sources
    assert len(names) >= 2 and fp["num_spans"] == 2 * len(names) and fp["per_source_k"] == 2
    assert {k: v["num_spans"] for k, v in fp["per_source"].items()} == dict.fromkeys(names, 2)
    assert [r["source"] for r in fp["spans"]] == [n for n in names for _ in range(2)]
    assert sum(v["num_qualified"] for v in fp["per_source"].values()) == fp["num_qualified"]


def test_harness_scoring_modes_on_the_cli(cli, trained_run, tmp_path):
    results = {}
    for scoring in ("decode", "parallel"):
        out = tmp_path / f"{scoring}.json"
        code, stdout, _ = cli("eval", "harness", "--checkpoint", str(trained_run), "--tasks", "megaloop_toy_mc",
                              "--limit", "4", "--scoring", scoring, "--decode-depth", "2", "--json", str(out))
        assert code == 0
        results[scoring] = json.loads(out.read_text())["config"]
    assert results["decode"]["scoring"] == "decode" and results["decode"]["decode_depth"] == 2
    assert results["parallel"]["scoring"] == "parallel"


def test_adaptive_exit_options_reach_ppl_harness_and_generate(cli, trained_run, tmp_path):
    """--exit (issue 15) through every command: a huge ε stops every decoded token at --min-depth."""
    ck = str(trained_run)
    code, out, _ = cli("generate", "--checkpoint", ck, "--prompt", "The", "--max-new-tokens", "4",
                       "--exit", "latent:1e9", "--min-depth", "2", "--max-depth", "8", "--json", str(tmp_path / "g.json"))
    assert code == 0 and "adaptive latent" in out and "mean depth 2.00" in out
    g = json.loads((tmp_path / "g.json").read_text())
    assert g["engine"]["exit"]["criterion"].startswith("latent") and g["stats"]["mean_depth"] == 2.0
    code, out, _ = cli("eval", "ppl", "--checkpoint", ck, "--max-seqs", "1", "--no-native", "--cache", "terminal",
                       "--exit", "latent:1e9", "--max-depth", "8", "--json", str(tmp_path / "p.json"))
    assert code == 0 and "adaptive decode" in out
    p = json.loads((tmp_path / "p.json").read_text())
    # per cache protocol, over the scored tokens only (item 9 of the eval audit)
    t = p["adaptive_depths"]["terminal"]
    assert t["mean_depth"] == 2.0 and t["tokens"] == p["tokens_scored"] > 0 and set(p["adaptive_depths"]) == {"terminal"}
    assert "scored tokens" in out
    code, out, _ = cli("eval", "harness", "--checkpoint", ck, "--tasks", "megaloop_toy_mc", "--limit", "2",
                       "--exit", "kl:1e9", "--max-depth", "6")
    assert code == 0
    code, _, err = cli("generate", "--checkpoint", ck, "--prompt", "x", "--exit", "nope:1")
    assert code == 2 and "--exit" in err


def test_harness_under_a_nonzero_local_rank_is_an_error_not_empty_results(cli, trained_run, tmp_path, monkeypatch):
    """lm-eval returns nothing where LOCAL_RANK != 0 (its TP-launcher rule); eval harness used to write
    a harness.json with empty results then (a leaked LOCAL_RANK emptied `megaloop reproduce`'s
    downstream column). Now one line, exit 2, nothing written."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    out = tmp_path / "h.json"
    code, _, err = cli("eval", "harness", "--checkpoint", str(trained_run), "--tasks", "megaloop_toy_mc",
                       "--limit", "2", "--json", str(out))
    assert code == 2 and "lm-eval returned no results in this process (LOCAL_RANK=1)" in err, err
    assert not out.exists()


def test_student_option_is_wired_and_checked(cli, trained_run, tmp_path):
    """--student DIR reaches ppl / harness / generate (issue 14); a folder that is not a student exits 2.
    eval ppl's --cache defaults to the terminal protocol with --student (both protocols without)."""
    for argv in (["eval", "ppl", "--max-seqs", "1"], ["generate", "--prompt", "x"]):
        code, _, err = cli(*argv, "--checkpoint", str(trained_run), "--student", str(tmp_path / "none"))
        assert code == 2 and "--student" in err and "has no student.json" in err, err
    code, _, err = cli("eval", "ppl", "--max-seqs", "1", "--cache", "both", "--checkpoint", str(trained_run),
                       "--student", str(tmp_path / "none"))
    assert code == 2 and "--cache both would also score per_visit" in err, err


@pytest.mark.parametrize("argv", [
    ["eval", "states", "--exit", "latent:1e-3"], ["eval", "states", "--cache", "per_visit"],
    ["eval", "fixed-point", "--decode-depth", "3"], ["eval", "fixed-point", "--finished-rows", "compact"],
    ["eval", "sweep", "--cache", "per_visit"],
    ["eval", "states", "--batch-size", "2"], ["eval", "fixed-point", "--batch-size", "2"],  # one forward / span by span
])
def test_options_a_command_would_ignore_are_refused(cli, trained_run, argv):
    """Decode options exist only where they act: states / fixed-point never decode, sweep --sharing scores
    both cache modes; argparse refuses them (exit 2, naming the option) instead of ignoring them."""
    code, _, err = cli(*argv, "--checkpoint", str(trained_run))
    assert code == 2 and "unrecognized arguments: " + argv[2] in err
    assert err.startswith(f"usage: megaloop {argv[0]} {argv[1]} ["), err  # the command's usage, not the top level's


def test_stop_strings_read_backslash_escapes():
    """--stop '\\n\\n' from a shell is a blank line, not four characters; other text is kept as typed."""
    from megaloop.cli import build_parser

    args = build_parser().parse_args(["generate", "--checkpoint", "x", "--prompt", "p", "--stop", r"\n\n",
                                      "--stop", r"a\\n", "--stop", r"é\tz\q"])
    assert args.stop == ["\n\n", "a\\n", "é\tz\\q"]
