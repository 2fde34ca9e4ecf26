"""The synthetic-program scorer (megaloop.eval.synth) against explicit forward calls on a tiny random
model; the shipped lm-eval group megaloop_synth against the same function; the eval-synth command."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from megaloop.config_utils import ConfigError
from megaloop.eval.synth import SHIPPED, load_problems, plot_synth, synth_table
from megaloop.inference.engine import InferenceEngine
from tests.inference.helpers import make_model

ALPHA = "\x00\x01\x020123456789abcdefghijkmnpqrstuvwxyz=+-*%()#?\n"  # every character of the programs


class ProgTokenizer:
    """One id per character of ALPHA; EOS 0, BOS 1, pad 2."""

    eos_id, bos_id, pad_id = 0, 1, 2
    vocab_size = len(ALPHA)

    def encode(self, text: str) -> list[int]:
        return [ALPHA.index(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(ALPHA[int(i)] for i in ids)


@pytest.fixture(scope="module")
def engine():
    model = make_model(seed=11, vocab=64, real_vocab=len(ALPHA), max_position_embeddings=128)
    return InferenceEngine(model, ProgTokenizer(), depth=3)


def hand_logits(model, ctx: list[int], cont: list[int], depth: int, mode: str) -> torch.Tensor:
    """Logits [len(cont), V] predicting each continuation token, by explicit model calls:
    ``none``: one parallel forward over ctx + cont[:-1]; ``terminal``: prefill ctx into a terminal
    cache at ``depth``, then one forward per continuation token."""
    v = len(ALPHA)
    with torch.no_grad():
        if mode == "none":
            ids = torch.tensor([ctx + cont[:-1]])
            return model(ids, num_recurrences=depth).logits[0, len(ctx) - 1:, :v].float()
        cache = model.new_cache("terminal")
        out = [model(torch.tensor([ctx]), past_key_values=cache, use_cache=True,
                     num_recurrences=depth).logits[0, -1, :v].float()]
        for tok in cont[:-1]:
            out.append(model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True,
                             num_recurrences=depth).logits[0, -1, :v].float())
        return torch.stack(out)


def hand_greedy(model, ctx: list[int], n: int, depth: int, mode: str) -> list[int]:
    """``n`` greedy tokens after ``ctx`` (same protocol as :func:`hand_logits`)."""
    out: list[int] = []
    for _ in range(n):
        lg = hand_logits(model, ctx, out + [0], depth, mode)
        out.append(int(lg[-1].argmax()))
    return out


def hand_score(model, ctx: list[int], cont: list[int], depth: int, mode: str) -> tuple[float, bool]:
    lp = torch.log_softmax(hand_logits(model, ctx, cont, depth, mode).double(), -1)
    target = torch.tensor(cont)
    return float(-lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())


@pytest.mark.parametrize("mode", ["terminal", "none"])
@pytest.mark.parametrize("depth", [1, 3])
def test_table_equals_hand_computed_scores(engine, mode, depth):
    tok, model = engine.tokenizer, engine.model
    # k=1: a program whose trailing newline moves onto the continuation ("\n2\n"), as in lm-eval
    p1 = {"k": 1, "prompt": "x=3\nx+=6\nprint(x%7)\n", "target": "2\n", "modulus": 7}
    # k=2: the model's own greedy answer (correct) and a wrong one (not greedy)
    ctx = "y=5\ny*=3\ny-=1\nprint(y%7)"
    greedy = tok.decode(hand_greedy(model, tok.encode(ctx), 2, depth, mode))
    p2 = {"k": 2, "prompt": ctx, "target": greedy, "modulus": 7}
    p3 = {"k": 2, "prompt": ctx, "target": "6\n" if greedy != "6\n" else "5\n", "modulus": 7}
    table = synth_table(engine, [p1, p2, p3], [depth], cache_mode=mode, batch_size=2)
    s1 = hand_score(model, tok.encode(p1["prompt"][:-1]), tok.encode("\n" + p1["target"]), depth, mode)
    s2 = hand_score(model, tok.encode(ctx), tok.encode(p2["target"]), depth, mode)
    s3 = hand_score(model, tok.encode(ctx), tok.encode(p3["target"]), depth, mode)
    assert s2[1] and not s3[1]
    assert table.ks == [1, 2] and table.n == [1, 2] and table.depths == [depth]
    assert table.acc[0][0] == float(s1[1])
    assert table.acc[1][0] == 0.5
    assert table.ce[0][0] == pytest.approx(s1[0], abs=1e-5)
    assert table.ce[1][0] == pytest.approx((s2[0] + s3[0]) / 2, abs=1e-5)
    assert table.chance == pytest.approx(1 / 7)


def test_depth_changes_the_scores(engine):
    problems = load_problems(SHIPPED, ks=[2, 5], limit_per_k=3)
    table = synth_table(engine, problems, [1, 4], batch_size=4)
    assert table.ks == [2, 5] and table.n == [3, 3]
    assert all(abs(row[0] - row[1]) > 1e-4 for row in table.ce)
    assert all(0.0 <= a <= 1.0 for row in table.acc for a in row)


def test_lm_eval_group_equals_the_function(engine):
    from megaloop.eval.harness import MegaloopLM, run_harness

    lm = MegaloopLM(engine, depth=2, cache_mode="terminal")
    res = run_harness(lm, ["megaloop_synth"], limit=2)["results"]
    table = synth_table(engine, load_problems(SHIPPED, limit_per_k=2), [2], cache_mode="terminal")
    for i, k in enumerate(table.ks):
        got = res[f"megaloop_synth_k{k}"]
        assert got["acc"] == pytest.approx(table.acc[i][0])
        assert got["ce"] == pytest.approx(table.ce[i][0], rel=1e-6)
    assert res["megaloop_synth"]["ce"] == pytest.approx(sum(r[0] for r in table.ce) / len(table.ks), rel=1e-6)


def test_load_problems_errors_name_the_line(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"k": 1, "prompt": "x=1\\n", "target": "1\\n"}\n{"k": "2", "prompt": "a", "target": "b"}\n')
    with pytest.raises(ConfigError, match=r"p.jsonl:2: field 'k'"):
        load_problems(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_problems(tmp_path / "none.jsonl")
    with pytest.raises(ConfigError, match="no problem with k in"):
        load_problems(SHIPPED, ks=[99])
    assert [p["k"] for p in load_problems(SHIPPED, ks=[3], limit_per_k=4)] == [3] * 4
    # a line that is JSON but not an object, a file that is not UTF-8, a directory: tracebacks or "does not exist"
    bad.write_text("5\n")
    with pytest.raises(ConfigError, match=r"p.jsonl:1: a record is a JSON object with k, prompt and target"):
        load_problems(bad)
    bad.write_bytes(b"caf\xe9\n")
    with pytest.raises(ConfigError, match=r"p.jsonl: not UTF-8"):
        load_problems(bad)
    with pytest.raises(ConfigError, match="is a directory, not a JSONL file"):
        load_problems(tmp_path)


def test_ks_and_problems_longer_than_the_context(engine, tmp_path, capsys):
    """--ks 4-2 blamed the problems file ("holds no problem"); --ks 1,9 dropped 9 silently; a problem longer
    than the context lost its start (the assignment its answer needs) and was scored without a word."""
    from megaloop.eval.synth import score_problems
    from megaloop.eval.synth_cli import _parse_ks

    with pytest.raises(ConfigError, match=r"--ks: the range '4-2' runs backwards"):
        _parse_ks("4-2")
    with pytest.raises(ConfigError, match=r"--ks: '' is not k or k1-k2"):
        _parse_ks(",")
    assert {p["k"] for p in load_problems(SHIPPED, ks=[1, 99])} == {1}
    assert "holds no problem with k in [99]: scoring k in [1]" in capsys.readouterr().err
    long = {"k": 30, "prompt": "x=1\n" + "y=y+1\n" * 40 + "print(x)\n", "target": "1\n"}
    with pytest.raises(ConfigError, match=r"1 problem\(s\) \(k in \[30\]\) are longer than the model's context "
                                          r"of 128 tokens .*pass --max-context"):
        score_problems(engine, [long], depth=1)


def test_plot_and_format(engine, tmp_path):
    table = synth_table(engine, load_problems(SHIPPED, ks=[1, 2], limit_per_k=2), [1, 2])
    text = table.format()
    assert "R=1" in text and "R=2" in text and len(text.splitlines()) == 4
    png = plot_synth(table, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert table.to_dict()["chance"] == pytest.approx(1 / 5)
    assert math.isfinite(table.ce[0][0])


def test_eval_synth_command(tmp_path, capsys):
    """``megaloop eval synth`` on an HF folder (tiny random model + the character tokenizer)."""
    from megaloop.data.synth import write_char_tokenizer
    from megaloop.eval.synth_cli import add_synth_parser

    hf = tmp_path / "hf"
    make_model(seed=3, vocab=384, real_vocab=259, max_position_embeddings=128).save_pretrained(hf)
    write_char_tokenizer(hf)
    parser = argparse.ArgumentParser()
    add_synth_parser(parser.add_subparsers(dest="cmd"))
    out = tmp_path / "res.json"
    args = parser.parse_args(["synth", "--checkpoint", str(hf), "--depths", "1,2", "--ks", "1-2", "--limit", "2",
                              "--json", str(out), "--device", "cpu"])
    assert args.fn(args) == 0
    printed = capsys.readouterr().out
    assert "R=1" in printed and "wrote" in printed
    res = json.loads(out.read_text())
    assert res["ks"] == [1, 2] and res["depths"] == [1, 2] and res["n"] == [2, 2]
    assert (tmp_path / "res.png").is_file()
    bad = parser.parse_args(["synth", "--checkpoint", str(hf), "--depth", "3"])
    with pytest.raises(ConfigError, match="--depth: not used"):
        bad.fn(bad)


def test_eval_synth_scores_the_held_out_set_of_the_runs_own_tree(tmp_path, capsys, monkeypatch):
    """Without --problems the shipped set (the default settings' held-out problems) was scored whatever
    tree the run trained on: with another modulus, --eval-seed or --eval-ks the run had trained on up to
    109 of its 400 problems, with no note. The run's data.json -> the MDS manifest's input -> synth.json
    now lead to the tree's own heldout.jsonl."""
    from megaloop.data.synth import write_char_tokenizer
    from megaloop.eval.synth import run_heldout
    from megaloop.eval.synth_cli import add_synth_parser

    hf = tmp_path / "hf"
    make_model(seed=3, vocab=384, real_vocab=259, max_position_embeddings=128).save_pretrained(hf)
    write_char_tokenizer(hf)
    tree, mds = tmp_path / "tree", tmp_path / "mds"
    tree.mkdir()
    mds.mkdir()
    own = [r for r in map(json.loads, SHIPPED.read_text().splitlines()) if r["k"] == 2][:3]
    (tree / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in own))
    assert run_heldout(hf) is None  # no data.json: the shipped set, as before
    (hf / "data.json").write_text(json.dumps({"path": str(mds)}))
    (mds / "manifest.json").write_text(json.dumps({"input": str(tree)}))
    assert run_heldout(hf) is None  # a tree without synth.json (not a finished make_synth tree)
    (tree / "synth.json").write_text(json.dumps({"heldout": {"file": "heldout.jsonl", "num": 3}}))
    assert run_heldout(hf) == tree / "heldout.jsonl"
    # the converter records --input as typed: relative to where it ran, not to where eval runs
    (mds / "manifest.json").write_text(json.dumps({"input": "tree"}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert run_heldout(hf) == tree / "heldout.jsonl"
    parser = argparse.ArgumentParser()
    add_synth_parser(parser.add_subparsers(dest="cmd"))
    out = tmp_path / "res.json"
    args = parser.parse_args(["synth", "--checkpoint", str(hf), "--depths", "1", "--json", str(out), "--device", "cpu"])
    assert args.fn(args) == 0
    printed, err = capsys.readouterr()
    assert f"problems: {tree / 'heldout.jsonl'} (the held-out set of the synthetic tree" in printed
    # a tree of generator 1 (no "generator" in synth.json) may have trained on held-out answers: said, also
    # with --problems; a tree of generator 2 is not
    assert f"note: {tree} was made by an earlier make_synth.py" in err
    args = parser.parse_args(["synth", "--checkpoint", str(hf), "--depths", "1", "--json", str(out_json := tmp_path / "r2.json"),
                              "--device", "cpu", "--problems", str(tree / "heldout.jsonl")])
    assert args.fn(args) == 0 and "was made by an earlier make_synth.py" in capsys.readouterr().err
    (tree / "synth.json").write_text(json.dumps({"generator": 2, "heldout": {"file": "heldout.jsonl", "num": 3}}))
    assert args.fn(args) == 0 and "earlier make_synth.py" not in capsys.readouterr().err and out_json.is_file()
    res = json.loads(out.read_text())
    assert res["problems"] == str(tree / "heldout.jsonl") and res["ks"] == [2] and res["n"] == [3]
    args = parser.parse_args(["synth", "--checkpoint", str(hf), "--depths", "1", "--ks", "1", "--limit", "1",
                              "--problems", str(SHIPPED), "--json", str(out), "--device", "cpu"])
    assert args.fn(args) == 0 and json.loads(out.read_text())["problems"] == str(SHIPPED)  # --problems wins
