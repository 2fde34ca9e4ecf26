"""Audit fixes of the eval / generate commands: a sweep's adaptive exit is capped at each row's R
(latent:0 equals fixed decoding per row), adaptive stats count the scored tokens per protocol,
outputs may not overwrite inputs, --plot is checked before compute, JSON has no bare NaN, and bad
flags are refused in one line before the model loads."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megaloop.config_utils import ConfigError
from tests.inference.helpers import make_engine



def _data(n=3, L=12, seed=0):
    from megaloop.eval.text_data import EvalData

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 32, (n, L + 1), generator=g)
    mask = torch.ones(n, L)
    mask[:, -1] = 0  # the last position has no target
    return EvalData(tokens=ids[:, :L], labels=ids[:, 1:], loss_mask=mask, source="test")


@torch.no_grad()
def _decoded_ppl(eng, data, depth, mode):
    """PPL (over the padded head, as the protocol scores) of the second halves fed one token at a time
    at fixed depth ``depth`` through a ``mode`` cache, with plain model calls."""
    split, nll, n = data.seq_len // 2, 0.0, 0.0
    cache = eng.model.new_cache(mode)
    eng.model(data.tokens[:, :split], past_key_values=cache, use_cache=True, num_recurrences=depth)
    for j in range(split, data.seq_len):
        logits = eng.model(data.tokens[:, j:j + 1], past_key_values=cache, use_cache=True,
                           num_recurrences=depth).logits[:, -1].float()
        ce = torch.nn.functional.cross_entropy(logits, data.labels[:, j], reduction="none")
        nll += float((ce * data.loss_mask[:, j]).sum())
        n += float(data.loss_mask[:, j].sum())
    return math.exp(nll / n)


def test_latent0_sweep_rows_equal_fixed_decoding_at_each_rows_depth():
    from megaloop.eval.depth_sweep import depth_sweep

    data = _data()
    fixed = depth_sweep(make_engine(depth=3, seed=2), data, [1, 2, 5], sharing=True, batch_size=3)
    eng = make_engine(depth=3, seed=2)
    eng.exit = eng.policy("latent:0")  # capped at the engine's decode depth (3) when built
    ada = depth_sweep(eng, data, [1, 2, 5], sharing=True, batch_size=3)
    assert eng.exit is not None and eng.exit.max_depth == 3  # restored
    ref = make_engine(depth=3, seed=2)
    for f, a in zip(fixed["rows"], ada["rows"]):
        d = a["depth"]
        # per-visit: token by token at R equals the parallel protocol at R (the non-adaptive row)
        assert a["per_visit_ppl"] == pytest.approx(f["per_visit_ppl"], rel=1e-5), d
        # terminal: equals fixed-depth decoding at the row's R (not at the run's decode depth 3)
        if d > 1:
            assert a["terminal_ppl"] == pytest.approx(_decoded_ppl(ref, data, d, "terminal"), rel=1e-5), d
    assert ada["rows"][1]["per_visit_ppl"] != pytest.approx(ada["rows"][2]["per_visit_ppl"], rel=1e-4)
    by = {r["depth"]: r for r in ada["rows"]}
    assert by[1]["adaptive_depths"] is None  # R=1 < min_depth 2: fixed depth
    for d in (2, 5):
        for mode in ("terminal", "per_visit"):
            st = by[d]["adaptive_depths"][mode]
            assert st["max_depth"] == d and st["mean_depth"] == d and st["histogram"] == {d: st["tokens"]}
            assert st["tokens"] == int(data.loss_mask[:, data.seq_len // 2:].sum())  # scored tokens only


def test_sweep_rows_below_min_depth_decode_token_by_token_at_their_depth():
    """A --sharing --exit sweep row whose R is below --min-depth (no criterion can fire) was scored
    in the one parallel pass while the other rows decoded: one sweep mixed two protocols, and the
    sharing penalty could change sign. It now decodes token by token at fixed R."""
    from megaloop.eval.depth_sweep import depth_sweep

    data = _data()
    eng = make_engine(depth=5, seed=2)
    eng.exit = eng.policy("latent:0", min_depth=4)
    res = depth_sweep(eng, data, [1, 2, 3, 5], sharing=True, batch_size=3)
    ref = make_engine(depth=5, seed=2)
    by = {r["depth"]: r for r in res["rows"]}
    for d in (2, 3):  # below min_depth 4
        assert by[d]["adaptive_depths"] is None
        for mode in ("terminal", "per_visit"):
            assert by[d][f"{mode}_ppl"] == pytest.approx(_decoded_ppl(ref, data, d, mode), rel=1e-5), (d, mode)
    parallel = depth_sweep(make_engine(depth=5, seed=2), data, [3], sharing=True, batch_size=3)["rows"][0]
    assert by[3]["terminal_ppl"] != pytest.approx(parallel["terminal_ppl"], rel=1e-6)  # not the parallel pass
    assert by[1]["terminal_ppl"] == pytest.approx(_decoded_ppl(ref, data, 1, "terminal"), rel=1e-5)
    assert by[5]["adaptive_depths"]["terminal"]["max_depth"] == 5


def test_ppl_adaptive_stats_are_per_protocol_over_scored_tokens():
    from megaloop.eval.ppl import evaluate_ppl

    data = _data(n=2, L=10)
    eng = make_engine(depth=3, seed=1)
    eng.exit = eng.policy("latent:1e-3", max_depth=4)
    res = evaluate_ppl(eng, data, protocols=("terminal", "per_visit"), batch_size=2)
    assert set(res.adaptive_depths) == {"terminal", "per_visit"}
    for st in res.adaptive_depths.values():
        assert st["tokens"] == res.tokens_scored == 8
    json.dumps(res.to_dict(), allow_nan=False)


def test_write_json_writes_null_for_nan(tmp_path, capsys):
    from megaloop.inference.generate_cli import write_json

    out = tmp_path / "x.json"
    write_json(str(out), {"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": torch.tensor(float("nan")).item()}})
    data = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert data == {"a": None, "b": [1.0, None], "c": {"d": None}}


def _no_load(monkeypatch):
    import megaloop.eval.cli as eval_cli
    import megaloop.eval.synth_cli as synth_cli
    import megaloop.inference.generate_cli as gen_cli

    for mod in (eval_cli, synth_cli, gen_cli):
        monkeypatch.setattr(mod, "build_engine", lambda *a, **k: pytest.fail("the model was loaded first"))


def test_outputs_may_not_overwrite_inputs(cli, trained_run, tmp_path, monkeypatch):
    _no_load(monkeypatch)
    run = str(trained_run)
    victim = tmp_path / "victim.jsonl"
    victim.write_text('{"text": "hello"}\n')
    code, err = cli("eval", "ppl", "--checkpoint", run, "--data", str(victim), "--json", str(victim))
    assert code == 2 and err.startswith("megaloop: error: --json ") and "--data" in err, err
    tok = tmp_path / "victok.json"
    tok.write_text("{}")
    code, err = cli("generate", "--checkpoint", run, "--prompt", "a", "--tokenizer", str(tok), "--json", str(tok))
    assert code == 2 and "--json" in err and "--tokenizer" in err, err
    code, err = cli("eval", "sweep", "--checkpoint", run, "--json", str(trained_run / "config.yaml"))
    assert code == 2 and "--json" in err and "--checkpoint" in err, err
    assert victim.read_text() == '{"text": "hello"}\n' and tok.read_text() == "{}"
    # an earlier result of the command in the run directory may be written again (quickstart, synth.sh)
    from megaloop.inference.generate_cli import check_outputs_not_inputs

    earlier = trained_run / "an_earlier_sweep.json"
    earlier.write_text("{}")
    try:
        args = SimpleNamespace(checkpoint=run, data="default", tokenizer=None, problems=None, student=None)
        check_outputs_not_inputs(args, {"--json": str(earlier), "--plot": str(trained_run / "depth_sweep.png")})
        with pytest.raises(ConfigError, match="lies inside the input --checkpoint"):
            check_outputs_not_inputs(args, {"--json": str(trained_run / "checkpoints" / "latest")})
    finally:
        earlier.unlink()


def test_plot_path_is_checked_before_compute(cli, trained_run, tmp_path, monkeypatch):
    _no_load(monkeypatch)
    run = str(trained_run)
    code, err = cli("eval", "sweep", "--checkpoint", run, "--plot", str(tmp_path / "out.txt"))
    assert code == 2 and "--plot" in err and "unsupported figure format 'txt'" in err, err
    (tmp_path / "file").write_text("x")
    code, err = cli("eval", "sweep", "--checkpoint", run, "--plot", str(tmp_path / "file" / "x.png"))
    assert code == 2 and "--plot" in err and "is a file" in err, err
    code, err = cli("eval", "synth", "--checkpoint", run, "--plot", str(tmp_path))
    assert code == 2 and "--plot" in err and "is a directory" in err, err


def test_plot_without_extension_is_a_png_and_named(tmp_path):
    from megaloop.inference.generate_cli import check_plot_path

    # under tmp_path: a fixed /tmp/sw failed wherever such a folder existed
    assert str(check_plot_path(str(tmp_path / "sw"), None, "x.png")) == str(tmp_path / "sw.png")
    assert str(check_plot_path(None, str(tmp_path / "a.json"), "x.png")) == str(tmp_path / "a.png")


def test_default_plot_never_replaces_an_earlier_one(tmp_path, monkeypatch):
    """No --plot and no --json: depth_sweep.png in the working directory, or the next free -N name."""
    from megaloop.inference.generate_cli import check_plot_path

    monkeypatch.chdir(tmp_path)
    assert check_plot_path(None, None, "depth_sweep.png") == Path("depth_sweep.png")
    (tmp_path / "depth_sweep.png").write_bytes(b"earlier")
    (tmp_path / "depth_sweep-2.png").write_bytes(b"earlier")
    assert check_plot_path(None, None, "depth_sweep.png") == Path("depth_sweep-3.png")
    assert check_plot_path("depth_sweep.png", None, "x.png") == Path("depth_sweep.png")  # named: the user's call


@pytest.mark.parametrize("argv, msg", [
    (["eval", "ppl", "--decode-depth", "50"], "--decode-depth: eval ppl scores the second half in one parallel pass"),
    (["eval", "harness", "--tasks", "megaloop_toy_mc", "--limit", "0"], "--limit: must be a whole number >= 1"),
    (["eval", "harness", "--tasks", "megaloop_toy_mc", "--limit", "-1"], "--limit: must be a whole number >= 1"),
    (["eval", "harness", "--tasks", "megaloop_toy_mc", "--num-fewshot", "-1"], "--num-fewshot: must be >= 0"),
    (["eval", "harness", "--tasks", "megaloop_toy_mc", "--batch-size", "0"], "--batch-size: must be >= 1"),
    (["eval", "ppl", "--device", "bogus"], "--device bogus: not a device"),
    (["generate", "--prompt", "a", "--threads", "-1"], "--threads: must be >= 1"),
    (["generate", "--prompt", "a", "--threads", "0"], "--threads: must be >= 1"),
    (["eval", "sweep", "--sharing", "--max-depth", "4"], "--max-depth: eval sweep caps each row"),
])
def test_bad_flags_are_one_line_before_loading(cli, trained_run, monkeypatch, argv, msg):
    _no_load(monkeypatch)
    code, err = cli(*argv[:2] if argv[0] == "eval" else argv[:1], "--checkpoint", str(trained_run),
                    *(argv[2:] if argv[0] == "eval" else argv[1:]))
    assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, flag", [
    (["generate", "--prompt", "a", "--exit", "latent:1e-3"], "--exit"),
    (["eval", "ppl", "--exit", "kl:1e-3"], "--exit"),
    (["eval", "harness", "--tasks", "megaloop_toy_mc", "--exit", "kl:1e-3"], "--exit"),
    (["eval", "ppl", "--depth", "7"], "--depth"),
    (["eval", "sweep"], "eval sweep"),  # no depth flag given: the command is named
])
def test_untied_models_refuse_depth_flags_before_loading(cli, trained_run, monkeypatch, argv, flag):
    import megaloop.hf.load as load

    _no_load(monkeypatch)
    monkeypatch.setattr(load, "model_arch", lambda path: "untied")
    code, err = cli(*argv[:2] if argv[0] == "eval" else argv[:1], "--checkpoint", str(trained_run),
                    *(argv[2:] if argv[0] == "eval" else argv[1:]))
    assert code == 2 and f"error: {flag}: " in err and "untied (non-looped)" in err, err


def test_model_arch_reads_the_run_config(trained_run):
    from megaloop.hf.load import model_arch

    assert model_arch(trained_run) == "looped"


def test_harness_errors_become_one_line(monkeypatch):
    import lm_eval

    from megaloop.eval import harness

    def offline(**kw):
        try:
            raise ConnectionError("Offline mode is enabled")
        except ConnectionError as e:
            raise RuntimeError("wrapped") from e

    monkeypatch.setattr(lm_eval, "simple_evaluate", offline)
    lm = type("LM", (), {"depth": 1, "prefill_depth": 1, "decode_depth": 1, "cache_mode": "terminal", "scoring": "decode"})
    with pytest.raises(ConfigError, match=r"--tasks hellaswag: the dataset .* could not be loaded .*offline"):
        harness.run_harness(lm, ["hellaswag"], resolved=(None, ["hellaswag"]))
    monkeypatch.setattr(lm_eval, "simple_evaluate",
                        lambda **kw: (_ for _ in ()).throw(ValueError("Sample larger than population or is negative")))
    with pytest.raises(ConfigError, match="--num-fewshot: 100"):
        harness.run_harness(lm, ["megaloop_toy_mc"], num_fewshot=100, resolved=(None, ["megaloop_toy_mc"]))
