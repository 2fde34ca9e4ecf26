"""Options the eval commands used to ignore or misread, on a tiny HF folder (character tokenizer):
synth --exit decoded every R column to one cap (the engine's decode depth) instead of R; synth and
harness accepted adaptive-depth options that parallel scoring never uses; copying dropped --depth
beside --depths and wrote no RoPE-extrapolation record; synth on an untied model printed identical
columns; --max-depth 0 meant "default"; --min-depth above the decode depth was blamed on
--max-depth; harness --exit was titled and recorded as fixed depth; --json and --plot could be one
file; /proc passed the --json writability check."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from megaloop.config_utils import ConfigError
from tests.inference.helpers import make_model

SYNTH = ("eval", "synth", "--ks", "1-2", "--limit", "2", "--device", "cpu")


def _folder(path: Path, **kw) -> Path:
    from megaloop.data.synth import write_char_tokenizer

    make_model(seed=3, vocab=384, real_vocab=259, max_position_embeddings=64, **kw).save_pretrained(path)
    write_char_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    """A looped 1/2/1 HF folder, decode depth 3, 64 positions."""
    return _folder(tmp_path_factory.mktemp("looped") / "hf")


@pytest.fixture(scope="module")
def hf_untied(tmp_path_factory) -> Path:
    return _folder(tmp_path_factory.mktemp("untied") / "hf", arch="untied", num_hidden_layers=2)


class Loaded(Exception):
    """Raised in place of loading the model: every pre-check passed."""


@pytest.fixture
def no_load(monkeypatch):
    """Loading the model fails the test: a refusal must come first."""
    import megaloop.eval.cli as eval_cli
    import megaloop.eval.synth_cli as synth_cli
    import megaloop.inference.generate_cli as gen_cli

    def forbidden(*a, **k):
        pytest.fail("the model was loaded before the refusal")

    for mod in (eval_cli, synth_cli, gen_cli):
        monkeypatch.setattr(mod, "build_engine", forbidden)


def _synth_args(*argv: str) -> argparse.Namespace:
    from megaloop.eval.synth_cli import add_synth_parser

    parser = argparse.ArgumentParser()
    add_synth_parser(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["synth", *argv])


# ----------------------------------------------------------------------------- item 1: synth --exit per R
def test_synth_exit_latent0_columns_equal_fixed_decoding_at_each_R(hf, tmp_path, capsys):
    """latent:0 never stops before the cap, so each R column must equal the fixed-depth decode at R;
    before, every column decoded to the engine's decode depth (3) and the columns were identical."""
    out = {}
    for name, extra in (("fixed", ()), ("latent0", ("--exit", "latent:0"))):
        args = _synth_args("--checkpoint", str(hf), "--depths", "2,8", "--prefill-depth", "3", "--ks", "1-2",
                           "--limit", "3", "--device", "cpu", "--json", str(tmp_path / f"{name}.json"), *extra)
        assert args.fn(args) == 0
        out[name] = json.loads((tmp_path / f"{name}.json").read_text())
    fixed, ada = out["fixed"], out["latent0"]
    assert [row[0] for row in fixed["ce"]] != pytest.approx([row[1] for row in fixed["ce"]], rel=1e-4)
    for f_row, a_row in zip(fixed["ce"], ada["ce"]):
        assert a_row == pytest.approx(f_row, rel=1e-5)
    assert ada["acc"] == fixed["acc"]
    assert ada["protocol"]["exit"] == {"criterion": "latent:0", "min_depth": 2, "max_depth": "R",
                                       "finished_rows": "mask"}
    assert fixed["protocol"]["exit"] is None and fixed["adaptive_depths"] is None
    for r, stats in zip(ada["depths"], ada["adaptive_depths"]):
        assert stats["max_depth"] == r and stats["tokens"] > 0 and stats["histogram"] == {str(r): stats["tokens"]}
    assert "R=8 adaptive decode (latent:0, max depth 8): mean depth 8.00" in capsys.readouterr().out


def test_decode_loglikelihood_takes_the_policy_it_is_given():
    """The scorer used the engine's exit policy whatever the caller asked for."""
    from megaloop.eval.decode_score import decode_loglikelihood
    from megaloop.eval.depth_sweep import row_policy
    from tests.inference.helpers import make_engine

    eng = make_engine(depth=3, seed=4)
    eng.exit = eng.policy("latent:0")  # capped at the decode depth 3
    pairs = [([3, 4, 5, 6], [7, 8, 9, 10]), ([3, 4], [11, 12, 13])]
    fixed5 = decode_loglikelihood(eng, pairs, prefill_depth=3, decode_depth=5)  # no policy: fixed D=5
    fixed3 = decode_loglikelihood(eng, pairs, prefill_depth=3, decode_depth=3)
    ada5 = decode_loglikelihood(eng, pairs, prefill_depth=3, decode_depth=5, policy=row_policy(eng.exit, 5))
    assert [lp for lp, _ in ada5] == pytest.approx([lp for lp, _ in fixed5], rel=1e-6)
    assert [g for _, g in ada5] == [g for _, g in fixed5]
    assert fixed3[0][0] != pytest.approx(fixed5[0][0], rel=1e-4)


# ----------------------------------------------------------------------------- item 2: parallel scoring
@pytest.mark.parametrize("argv, msg", [
    (["--cache", "none", "--exit", "latent:0"], "--exit: adaptive depth applies to token-by-token decode scoring; "
                                                "with --cache none"),
    (["--scoring", "parallel", "--exit", "kl:1e-3"], "--exit: adaptive depth applies to token-by-token decode "
                                                     "scoring; with --scoring parallel"),
    (["--scoring", "parallel", "--min-depth", "3"], "--min-depth: adaptive depth applies"),
    (["--cache", "none", "--finished-rows", "compact"], "--finished-rows: adaptive depth applies"),
    (["--cache", "none", "--prefill-depth", "2"], "--prefill-depth: with --cache none prompt and answer are scored "
                                                  "in one plain parallel forward"),
    (["--exit", "latent:0", "--max-depth", "4"], "--max-depth: eval synth caps the adaptive depth of each column"),
    (["--depths", "2,4", "--exit", "latent:0", "--min-depth", "5"], "--min-depth 5: above every depth of --depths"),
])
def test_synth_refuses_options_it_would_ignore(cli, hf, no_load, argv, msg):
    code, err = cli(*SYNTH, "--checkpoint", str(hf), *argv)
    assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, err


def test_synth_parallel_scoring_keeps_prefill_depth(hf, tmp_path):
    """--scoring parallel with a cache does prefill at --prefill-depth (not refused: it changes the scores)."""
    res = []
    for extra in ((), ("--prefill-depth", "5")):
        out = tmp_path / f"p{len(res)}.json"
        args = _synth_args("--checkpoint", str(hf), "--depths", "2", "--ks", "1", "--limit", "2", "--device", "cpu",
                           "--scoring", "parallel", "--json", str(out), *extra)
        assert args.fn(args) == 0
        res.append(json.loads(out.read_text())["ce"][0][0])
    assert res[0] != pytest.approx(res[1], rel=1e-4)


def test_harness_parallel_scoring_warns_that_decode_options_reach_generate_until_only(cli, hf, capsys):
    code, err = cli("eval", "harness", "--checkpoint", str(hf), "--tasks", "megaloop_synth_k1", "--limit", "2",
                    "--device", "cpu", "--cache", "none", "--exit", "latent:0", "--prefill-depth", "2")
    assert code == 0
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: --exit, --prefill-depth: with --cache none loglikelihood requests are scored in "
                        "one parallel pass at R, so these apply only to generate_until requests"], err
    code, err = cli("eval", "harness", "--checkpoint", str(hf), "--tasks", "megaloop_synth_k1", "--limit", "1",
                    "--device", "cpu", "--scoring", "parallel", "--prefill-depth", "2")
    assert code == 0 and "warning:" not in err, err  # a cache's prefill does use it


# ----------------------------------------------------------------------------- item 3, 5: copying
def test_copying_refuses_depth_beside_depths(cli, hf, no_load, capsys):
    code, err = cli("eval", "copying", "--checkpoint", str(hf), "--depth", "7", "--depths", "1,2")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--depth: eval copying runs the depths of --depths only (1,2); --depth sets the second of the default " \
           "depths {1, R}" in err, err
    from megaloop.cli import main

    with pytest.raises(SystemExit):
        main(["eval", "copying", "--help"])
    assert "the second of the default depths {1, R}" in " ".join(capsys.readouterr().out.split())


def test_copying_past_the_training_length_warns_and_records_it(cli, hf, tmp_path):
    out = tmp_path / "copy.json"
    code, err = cli("eval", "copying", "--checkpoint", str(hf), "--num-seqs", "2", "--half-len", "40",
                    "--max-context", "80", "--device", "cpu", "--json", str(out))
    assert code == 0
    assert "warning: 80-token sequences exceed the training seq_len 64: RoPE positions 64..79 were never trained " \
           "and are extrapolated" in err, err
    res = json.loads(out.read_text())
    assert res["training_seq_len"] == 64 and res["rope_extrapolated"] is True and res["seq_len"] == 80
    code, err = cli("eval", "copying", "--checkpoint", str(hf), "--num-seqs", "2", "--half-len", "8",
                    "--device", "cpu", "--json", str(out))
    assert code == 0 and "warning" not in err and json.loads(out.read_text())["rope_extrapolated"] is False


# ----------------------------------------------------------------------------- item 4, 9: untied models
def test_synth_on_an_untied_model_refuses_depths_and_scores_one_column(cli, hf_untied, tmp_path):
    code, err = cli(*SYNTH, "--checkpoint", str(hf_untied), "--depths", "1,2")
    assert code == 2 and "--depths: " in err and "is an untied (non-looped) model, it has no depth to vary" in err
    assert len(err.strip().splitlines()) == 1, err
    out = tmp_path / "u.json"
    code, _ = cli(*SYNTH, "--checkpoint", str(hf_untied), "--json", str(out))
    res = json.loads(out.read_text())
    assert code == 0 and res["depths"] == [3] and all(len(row) == 1 for row in res["ce"])  # the eval depth
    assert res["protocol"]["arch"].startswith("untied")


def test_sweep_on_an_untied_model_names_the_command_not_depths(cli, hf_untied, no_load):
    code, err = cli("eval", "sweep", "--checkpoint", str(hf_untied))
    assert code == 2 and err == (f"megaloop: error: eval sweep: {hf_untied} is an untied (non-looped) model, it has "
                                 "no depth to sweep (use eval ppl)"), err


# ----------------------------------------------------------------------------- item 6, 7: depth bounds
def test_max_depth_zero_is_refused_not_the_default(cli, hf, no_load):
    from megaloop.inference.adaptive import exit_policy

    with pytest.raises(ConfigError, match=r"^--max-depth: must be an integer >= min_depth \(2\), got 0$"):
        exit_policy("latent:1e-3", max_depth=0, default_max_depth=3)
    assert exit_policy("latent:1e-3", default_max_depth=3).max_depth == 3
    code, err = cli("generate", "--checkpoint", str(hf), "--prompt", "a", "--exit", "latent:1e-3", "--max-depth", "0")
    assert (code, err) == (2, "megaloop: error: --max-depth: must be an integer >= min_depth (2), got 0")


def test_hf_exit_policy_zero_depths_are_refused():
    model = make_model()
    assert model.exit_policy("latent:0").max_depth == model.config.decode_depth
    with pytest.raises(ValueError, match="max_depth: must be an integer >= min_depth"):
        model.exit_policy("latent:0", max_depth=0)
    with pytest.raises(ValueError, match="min_depth: must be an integer >= 2"):
        model.exit_policy("latent:0", min_depth=0)


def test_min_depth_above_the_default_cap_names_min_depth(cli, hf, no_load):
    from tests.inference.helpers import make_engine

    msg = "--min-depth 8: above the default --max-depth (the decode depth, 3); pass --max-depth >= 8"
    with pytest.raises(ConfigError) as info:
        make_engine(depth=3).policy("latent:1e-3", min_depth=8)
    assert str(info.value) == msg
    for extra in (("--depth", "3"), ("--decode-depth", "3")):  # known before loading: refused there
        code, err = cli("generate", "--checkpoint", str(hf), "--prompt", "a", "--exit", "latent:1e-3",
                        "--min-depth", "8", *extra)
        assert (code, err) == (2, f"megaloop: error: {msg}"), err


def test_min_depth_above_the_decode_depth_on_the_engine_built_by_the_cli(cli, hf, monkeypatch):
    """generate (decode depth from the checkpoint): the loaded engine's refusal names --min-depth;
    sweep --sharing and synth cap each row / column at its own R, so --min-depth above the run's
    decode depth loads (it failed, blaming the --max-depth they refuse)."""
    import megaloop.eval.cli as eval_cli
    import megaloop.eval.synth_cli as synth_cli
    from megaloop.cli import main

    code, err = cli("generate", "--checkpoint", str(hf), "--prompt", "a", "--exit", "latent:1e-3",
                    "--min-depth", "8", "--device", "cpu")
    assert (code, err) == (2, "megaloop: error: --min-depth 8: above the default --max-depth (the decode depth, "
                              "3); pass --max-depth >= 8")
    for mod, argv in ((eval_cli, ["eval", "sweep", "--sharing", "--depths", "4,8"]),
                      (synth_cli, [*SYNTH, "--depths", "4,8"])):
        real = mod.build_engine

        def build(args, real=real, **kw):
            raise Loaded(real(args, **kw).exit)

        monkeypatch.setattr(mod, "build_engine", build)
        with pytest.raises(Loaded) as info:
            main([*argv, "--checkpoint", str(hf), "--exit", "latent:0", "--min-depth", "4", "--device", "cpu"])
        policy = info.value.args[0]
        assert (policy.min_depth, policy.max_depth) == (4, 8)


# ----------------------------------------------------------------------------- item 8: harness --exit
def test_harness_exit_is_titled_adaptive_and_records_its_depths(cli, hf, tmp_path, capsys):
    from megaloop.cli import main

    out = tmp_path / "h.json"
    with pytest.raises(SystemExit) as info:  # the cli fixture keeps the session's world up; stdout is read here
        main(["eval", "harness", "--checkpoint", str(hf), "--tasks", "megaloop_synth_k1", "--limit", "2",
              "--device", "cpu", "--exit", "latent:0", "--max-depth", "5", "--json", str(out)])
    code, printed = info.value.code, " ".join(capsys.readouterr().out.split())
    assert code == 0 and "adaptive depth token by token (latent:0, depth 2..5)" in printed, printed
    res = json.loads(out.read_text())
    assert res["config"]["exit"] == {"criterion": "latent:0", "min_depth": 2, "max_depth": 5, "finished_rows": "mask"}
    st = res["adaptive_depths"]
    assert st["criterion"] == "latent:0" and st["max_depth"] == 5
    assert st["tokens"] > 0 and st["histogram"] == {"5": st["tokens"]}  # latent:0 runs to the cap


# ----------------------------------------------------------------------------- item 10, 11: output paths
def test_json_and_plot_may_not_be_one_file(cli, hf, no_load, tmp_path):
    from megaloop.inference.generate_cli import check_plot_path

    same = tmp_path / "r.png"
    for argv in (["--json", str(same), "--plot", str(same)], ["--json", str(same)]):  # named, and the default
        code, err = cli(*SYNTH, "--checkpoint", str(hf), *argv)
        assert code == 2 and "is also the --json path, so the figure would overwrite the JSON result" in err, err
    code, err = cli("eval", "sweep", "--checkpoint", str(hf), "--json", str(same), "--plot", str(tmp_path / "." / "r.png"))
    assert code == 2 and "--plot" in err and "is also the --json path" in err, err
    assert check_plot_path(None, str(tmp_path / "r.json"), "x.png") == tmp_path / "r.png"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_json_under_a_pseudo_file_system_is_refused_before_loading(cli, hf, no_load):
    from megaloop.inference.generate_cli import check_out_file

    with pytest.raises(ConfigError, match=r"^--json /proc/megaloop-none/y.json: /proc is not writable"):
        check_out_file("/proc/megaloop-none/y.json", "--json")
    code, err = cli(*SYNTH, "--checkpoint", str(hf), "--json", "/proc/megaloop-none/y.json")
    assert code == 2 and "--json /proc/megaloop-none/y.json: /proc is not writable" in err, err


def test_text_field_without_a_jsonl_or_parquet_data_file_is_refused(cli, hf, no_load, tmp_path):
    """--text-field on the default set, an MDS folder or a plain .txt was ignored without a word."""
    doc = tmp_path / "doc.txt"
    doc.write_text("some text\n")
    for cmd, data in (("ppl", "default"), ("sweep", str(doc)), ("states", str(tmp_path))):
        code, err = cli("eval", cmd, "--checkpoint", str(hf), "--data", data, "--text-field", "body")
        assert (code, err) == (2, f"megaloop: error: --text-field: applies to a .jsonl[.gz] or .parquet --data "
                                  f"file, not {data} (it would be ignored)"), (cmd, err)


# ----------------------------------------------------------------------------- states / fixed-point: context, help
def test_a_max_context_below_the_sequences_is_refused_by_every_verb(cli, hf, tmp_path, capsys):
    text = tmp_path / "doc.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    for verb in ("states", "ppl", "sweep"):  # states used to run at 48 tokens, ignoring --max-context
        code, err = cli("eval", verb, "--checkpoint", str(hf), "--data", str(text), "--seq-len", "48",
                        "--max-context", "40", "--max-seqs", "1", "--device", "cpu")
        assert code == 2 and "evaluation sequence has 48 tokens, longer than the model's context of 40 tokens" \
            in err, (verb, err)
    code, _ = cli("eval", "states", "--checkpoint", str(hf), "--data", str(text), "--seq-len", "48",
                  "--max-context", "48", "--max-seqs", "1", "--depth", "2", "--device", "cpu",
                  "--json", str(tmp_path / "st.json"))
    assert code == 0
    import json

    st = json.loads((tmp_path / "st.json").read_text())  # the protocol the table printed (it was left out)
    assert (st["num_seqs"], st["seq_len"], st["rope_extrapolated"]) == (1, 48, st["training_seq_len"] < 48), st
    from megaloop.cli import main

    with pytest.raises(SystemExit):  # fixed-point refuses --depth, so its help does not offer it
        main(["eval", "fixed-point", "--help"])
    assert "--depth " not in capsys.readouterr().out
    # nor do synth (--depth, --decode-depth) and sweep (--decode-depth): they offered them with defaults
    for verb, refused in (("synth", ("--depth ", "--decode-depth", "--max-depth")),
                          ("sweep", ("--decode-depth", "--max-depth"))):
        with pytest.raises(SystemExit):
            main(["eval", verb, "--help"])
        shown = capsys.readouterr().out
        assert not [flag for flag in refused if flag in shown] and "--prefill-depth" in shown, (verb, shown)


@pytest.mark.parametrize("argv, msg", [
    # bytes that are not UTF-8 (a shell's $'abc\xff') were a tokenizer TypeError traceback after the load
    (("--prompt", "ok", "--prompt", "abc\udcff"), "--prompt (#2): not UTF-8 text (byte 0xff at character 3)"),
    # sampling options were checked only when sampling began, after the model loaded (a load error hid them)
    (("--prompt", "a", "--temperature", "1", "--top-k", "-3"), "--top-k: must be >= 0 (0 = off), got -3"),
    (("--prompt", "a", "--temperature", "-1"), "--temperature: must be >= 0, got -1.0"),
    (("--prompt", "a", "--temperature", "1", "--top-p", "2"), "--top-p: must be in (0, 1], got 2.0"),
])
def test_generate_refuses_bad_prompts_and_sampling_options_before_loading(cli, hf, no_load, argv, msg):
    code, err = cli("generate", "--checkpoint", str(hf), *argv)
    assert (code, err) == (2, f"megaloop: error: {msg}")


@pytest.mark.parametrize("argv", [
    ("generate", "--prompt", "a", "--temperature", "1", "--seed", "18446744073709551616"),
    ("generate", "--prompt", "a", "--temperature", "1", "--seed", "-1"),
    ("eval", "copying", "--seed", "99999999999999999999999"),
])
def test_a_seed_torch_cannot_take_is_refused_before_loading(cli, hf, no_load, argv):
    """A seed past 2**64 overflowed inside torch after the model loaded (traceback, exit 1)."""
    code, err = cli(*argv, "--checkpoint", str(hf))
    assert code == 2 and "argument --seed: must be in [0, 2**64), got" in err, err


def test_an_empty_checkpoint_is_refused_not_the_working_directory(cli, no_load):
    """`--checkpoint "$CKPT"` with the variable unset loaded the working directory's run."""
    code, err = cli("generate", "--prompt", "a", "--checkpoint", "")
    assert code == 2 and "argument --checkpoint: empty path (an unset shell variable?)" in err, err
    code, err = cli("generate", "--prompt", "a", "--checkpoint", "x", "--exit", "")  # was fixed depth, silently
    assert code == 2 and "argument --exit: empty value (an unset shell variable?)" in err, err


def test_ppl_on_an_untied_model_prints_no_sharing_penalty(megatron_world, hf_untied, tmp_path, monkeypatch, capsys):
    """An untied model has one pass: terminal and per-visit caches are the same, and eval ppl printed a
    meaningless 'sharing penalty ... = +0.0000 %' line as if one had been measured."""
    import megaloop.runtime.parallel as parallel
    from megaloop.cli import main

    monkeypatch.setattr(parallel, "destroy_distributed", lambda: None)
    text = tmp_path / "t.txt"
    text.write_text("x = 1\ny = x + 2\nprint(y)\n" * 20)
    with pytest.raises(SystemExit) as done:
        main(["eval", "ppl", "--checkpoint", str(hf_untied), "--data", str(text), "--seq-len", "32",
              "--max-seqs", "2", "--device", "cpu"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "sharing penalty: none (an untied model has one pass" in out, out
    assert "PPL_terminal/PPL_fullKV" not in out


def test_a_folders_generation_settings_other_than_the_commands_are_noted(cli, hf, tmp_path):
    """An HF folder saved with prefill_recurrences / decode_recurrences / kv_cache_mode (HF generate's
    defaults, the README's from_pretrained example): megaloop generate ran at its own defaults (R, R,
    terminal) without a word while HF generate on the folder used the folder's."""
    import shutil

    folder = tmp_path / "hf_settings"
    shutil.copytree(hf, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "prefill_recurrences": 8, "decode_recurrences": 4,
                                                    "kv_cache_mode": "per_visit"}))
    run = ("generate", "--prompt", "ab", "--max-new-tokens", "2", "--device", "cpu", "--checkpoint")
    code, err = cli(*run, str(folder))
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert code == 0 and notes == [f"note: {folder}'s config.json sets prefill_recurrences=8, decode_recurrences=4, "
                                   "kv_cache_mode=per_visit (HF generate's defaults); this command runs at "
                                   "--prefill-depth 3, --decode-depth 3, --cache terminal, its own options"], err
    code, err = cli(*run, str(folder), "--prefill-depth", "8", "--decode-depth", "4", "--cache", "per_visit")
    assert code == 0 and "note:" not in err, err
    code, err = cli(*run, str(hf))
    assert code == 0 and "note:" not in err, err
    # eval ppl scores its second half in one parallel pass (no decode depth without --exit) and its own
    # protocols (no cache mode): the prefill depth alone is named
    text = tmp_path / "t.txt"
    text.write_text("abc def ghi jkl mno pqr stu vwx yz " * 20)
    code, err = cli("eval", "ppl", "--checkpoint", str(folder), "--data", str(text), "--seq-len", "32", "--max-seqs",
                    "1", "--device", "cpu", "--cache", "per_visit")
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert code == 0 and notes == [f"note: {folder}'s config.json sets prefill_recurrences=8 (HF generate's "
                                   "defaults); this command runs at --prefill-depth 3, its own options"], err
