"""Evaluation sets and flags: a re-cut set keeps --max-seqs source-balanced and the PPL result counts the
scored sources; a --prefix-len that leaves no target is refused; the embedded default set's tokenizer
refusal points a custom-tokenizer run to its own data.val_path."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from megaloop.config_utils import ConfigError
from tests.conftest import bpe_tokenizer

SOURCES = ("arxiv", "code", "web")


def write_val_set(out: Path, per_source: int = 8, seq_len: int = 32) -> Path:
    """A MixVal-like MDS set: ``per_source`` rows of each source, one source after the other."""
    from megaloop.data.mds_convert import mds_columns, write_sequences_mds

    rng = np.random.default_rng(0)
    toks = rng.integers(3, 200, size=(per_source * len(SOURCES), seq_len)).astype(np.uint16)
    srcs = [s for s in SOURCES for _ in range(per_source)]
    write_sequences_mds(out, toks, srcs, compression=None)
    (out / "manifest.json").write_text(json.dumps({
        "format": "megaloop-mds-v1", "kind": "val", "seq_len": seq_len, "vocab_size": 256, "eos_id": 0,
        "columns": mds_columns(seq_len, "uint16"), "num_sequences": len(srcs), "fingerprint": "test-val"}))
    return out


def test_a_recut_set_keeps_max_seqs_source_balanced(tmp_path):
    from megaloop.eval.ppl import load_eval_data

    val = str(write_val_set(tmp_path / "val"))
    stored = load_eval_data(val, max_seqs=6)
    assert Counter(stored.sources) == {s: 2 for s in SOURCES}
    recut = load_eval_data(val, max_seqs=6, seq_len=16)  # 32-token rows re-cut into 16-token ones
    assert recut.seq_len == 16 and Counter(recut.sources) == {s: 2 for s in SOURCES}
    assert recut.sources == sorted(recut.sources)  # kept in file order
    assert Counter(load_eval_data(val, max_seqs=7, seq_len=64).sources) == {"arxiv": 3, "code": 2, "web": 2}
    assert load_eval_data(val, seq_len=16).num_seqs == 48  # no --max-seqs: every re-cut row


def test_the_ppl_result_counts_the_scored_sources(trained_engine, val_data):
    from megaloop.eval.ppl import EvalData, evaluate_ppl

    res = evaluate_ppl(trained_engine, val_data, protocols=("native",), batch_size=8).to_dict()
    assert res["source_counts"] == dict(sorted(Counter(val_data.sources).items()))
    assert sum(res["source_counts"].values()) == val_data.num_seqs
    plain = EvalData(val_data.tokens[:2], val_data.labels[:2], val_data.loss_mask[:2], "rows", None)
    assert evaluate_ppl(trained_engine, plain, protocols=("native",)).source_counts is None


def test_a_prefix_that_leaves_no_target_is_refused(trained_engine, val_data, monkeypatch):
    from megaloop.eval import ppl

    L = val_data.seq_len
    monkeypatch.setattr(trained_engine, "forward", lambda *a, **k: pytest.fail("scored before refusing"))
    monkeypatch.setattr(trained_engine, "score_with_prefix", lambda *a, **k: pytest.fail("scored before refusing"))
    for bad in (L - 1, L, 0):
        with pytest.raises(ConfigError, match=rf"^--prefix-len: must be in \[1, {L - 2}\] for {L}-token sequences"):
            ppl.evaluate_ppl(trained_engine, val_data, prefix_len=bad)
    ppl.check_prefix_len(126, 128)  # the last scored target is position 126's



def test_prefix_len_is_checked_on_the_cli(cli, trained_run, tmp_path, monkeypatch):
    import megaloop.eval.cli as eval_cli

    run = str(trained_run)
    build = eval_cli.build_engine
    monkeypatch.setattr(eval_cli, "build_engine", lambda *a, **k: pytest.fail("the model was loaded first"))
    assert cli("eval", "ppl", "--checkpoint", run, "--seq-len", "64", "--prefix-len", "63") == (
        2, "megaloop: error: --prefix-len: must be in [1, 62] for 64-token sequences (the last position has no "
           "target, so a longer prefix leaves no token to score), got 63")
    val = str(write_val_set(tmp_path / "val"))  # an MDS set: its manifest's length
    code, err = cli("eval", "sweep", "--checkpoint", run, "--data", val, "--sharing", "--prefix-len", "31")
    assert code == 2 and "--prefix-len: must be in [1, 30] for 32-token sequences" in err, err
    code, err = cli("eval", "ppl", "--checkpoint", run, "--prefix-len", "0")
    assert code == 2 and "--prefix-len: must be >= 1" in err, err
    # the default set at the training length (128), known once the model is loaded, before the data is read
    import megaloop.eval.ppl as ppl

    monkeypatch.setattr(eval_cli, "build_engine", build)
    monkeypatch.setattr(ppl, "load_eval_data", lambda *a, **k: pytest.fail("the data was read first"))
    code, err = cli("eval", "ppl", "--checkpoint", run, "--prefix-len", "127", "--max-seqs", "1")
    assert code == 2 and "--prefix-len: must be in [1, 126] for 128-token sequences" in err, err


def test_the_default_sets_refusal_suggests_the_runs_val_path(cli, trained_run, tmp_path):
    """A run trained with its own tokenizer, evaluated without --data: the embedded default set
    (another tokenizer) is refused, naming the run's data.val_path as the --data to pass."""
    import yaml

    run = tmp_path / "exp" / "runs" / "custom"
    shutil.copytree(trained_run / "checkpoints", run / "checkpoints")
    shutil.copyfile(bpe_tokenizer(tmp_path / "tok", 100, "a custom tokenizer for this run"), run / "tokenizer.json")  # what training copies
    val = write_val_set(tmp_path / "exp" / "data" / "val")
    cfg = yaml.safe_load((trained_run / "config.yaml").read_text())
    cfg["data"]["val_path"] = "data/val"  # relative to where training ran (tmp_path/exp)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    for cmd in ("ppl", "states"):
        code, err = cli("eval", cmd, "--checkpoint", str(run), "--max-seqs", "1")
        assert code == 2 and "--data: default was tokenised with tokenizer sha256" in err, err
        assert f"evaluate on the run's own validation set: --data {val} (data.val_path in {run / 'config.yaml'})" \
            in err, err
    cfg["data"]["val_path"] = None
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    code, err = cli("eval", "ppl", "--checkpoint", str(run), "--max-seqs", "1")
    assert code == 2 and "(rebuild the set, or pass the matching --tokenizer)" in err and "val_path" not in err, err
    # a --tokenizer that is not the set's is the one named (it used to be called "the checkpoint's tokenizer")
    code, err = cli("eval", "ppl", "--checkpoint", str(run), "--max-seqs", "1", "--tokenizer", str(run / "tokenizer.json"))
    assert code == 2 and "--data: default was tokenised with tokenizer sha256" in err, err
    assert f", --tokenizer {run / 'tokenizer.json'} is " in err and "checkpoint's tokenizer is" not in err, err



def test_a_run_that_masked_document_boundaries_is_scored_as_it_trained(cli, trained_run, trained_engine, val_data,
                                                                         tmp_path, monkeypatch):
    """`eval ppl` counted the target after each EOS that the run's own validation leaves out
    (data.mask_document_boundaries=true): on the same sequences it differed from the run's val_ppl."""
    import json

    import yaml

    run = tmp_path / "masked"
    shutil.copytree(trained_run / "checkpoints", run / "checkpoints")
    shutil.copyfile(trained_run / "tokenizer.json", run / "tokenizer.json")
    cfg = yaml.safe_load((trained_run / "config.yaml").read_text())
    cfg["data"]["mask_document_boundaries"] = True
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    res, errs = {}, {}
    for name, path in (("plain", trained_run), ("masked", run)):
        code, errs[name] = cli("eval", "ppl", "--checkpoint", str(path), "--max-seqs", "8",
                               "--json", str(tmp_path / f"{name}.json"))
        assert code == 0, errs[name]
        res[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert "mask_document_boundaries=true: the token after each EOS is not scored" in errs["masked"]
    assert "mask_document_boundaries" not in errs["plain"]
    eos = int(trained_engine.eos_id)
    after_eos = int(((val_data.tokens == eos) & (val_data.loss_mask > 0)).sum())
    assert after_eos > 0  # the embedded set's rows hold document boundaries
    assert res["plain"]["tokens_native"] - res["masked"]["tokens_native"] == after_eos
    assert res["masked"]["native_ppl"] != res["plain"]["native_ppl"]
    # eval states averages over the input tokens: it used the loss mask, which left each row's last token
    # (and, on a masked run, the token after each EOS) out, so a run and its HF export disagreed
    import torch

    from megaloop.eval.states import input_positions, trace_diagnostics

    for name, path in (("plain", trained_run), ("masked", run)):
        code, err = cli("eval", "states", "--checkpoint", str(path), "--max-seqs", "2", "--depth", "3",
                        "--json", str(tmp_path / f"states_{name}.json"))
        assert code == 0, err
        res[name] = json.loads((tmp_path / f"states_{name}.json").read_text())
    from megaloop.eval.ppl import load_eval_data

    two = load_eval_data("default", default_seq_len=trained_engine.max_context, max_seqs=2,
                         vocab_size=trained_engine.vocab_size)  # the rows --max-seqs 2 picks (one per source)
    every = trace_diagnostics(trained_engine.model, two.tokens, 3)
    targets = trace_diagnostics(trained_engine.model, two.tokens, 3, mask=two.loss_mask)
    for name in ("plain", "masked"):
        assert abs(res[name]["rms_e"] - every["rms_e"]) < 1e-6 * every["rms_e"], (name, res[name]["rms_e"], every["rms_e"])
    assert abs(targets["rms_e"] - every["rms_e"]) > 1e-5 * every["rms_e"]  # the check can tell them apart
    padded = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0, 0.0]])  # row 0: 3 real tokens, then padding
    assert input_positions(padded).tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0], [1.0] * 5]
    # a row whose next-to-last token is EOS: the boundary mask zeroes its last target, and positions taken
    # from that mask left the row's real last token out (the run and its export still disagreed)
    import megaloop.eval.ppl as ppl
    from megaloop.eval.text_data import EvalData, shifted_targets

    edge = two.tokens[:1].clone()
    edge[0, -2] = int(trained_engine.eos_id)
    monkeypatch.setattr(ppl, "load_eval_data", lambda *a, **k: EvalData(edge, *shifted_targets(edge, trained_engine.eos_id)))
    code, err = cli("eval", "states", "--checkpoint", str(run), "--max-seqs", "1", "--depth", "3",
                    "--json", str(tmp_path / "edge.json"))
    assert code == 0, err
    got = json.loads((tmp_path / "edge.json").read_text())["rms_e"]
    want = trace_diagnostics(trained_engine.model, edge, 3)["rms_e"]
    assert abs(got - want) < 1e-6 * want, (got, want)
