"""The trusted verdict: test parsing, the wire format and type-strict comparison (no sandbox)."""

from __future__ import annotations

import ast
import json

import pytest

from megaloop.post.rl.sandbox_harness import NotPlainData, decode_value, encode_value
from megaloop.post.rl.verdict import Outcome, TestCase, matches, parse_tests, read_channel, score, strict_equal


@pytest.mark.parametrize("value", [None, True, False, 0, -7, 2**80, 1.5, float("inf"), "s", b"\x00b", [1, [2]],
                                   (1, "a"), {1, 2}, frozenset({(1, 2)}), {"a": [1], (1, 2): None}, [(), [], {}]])
def test_wire_round_trip_keeps_exact_types(value):
    back = decode_value(json.loads(json.dumps(encode_value(value), allow_nan=False)))
    assert back == value and type(back) is type(value)
    assert strict_equal(back, value)


@pytest.mark.parametrize("value", [object(), 1j, type("I", (int,), {})(3), type("L", (list,), {})(), print])
def test_non_plain_values_are_refused(value):
    with pytest.raises(NotPlainData):
        encode_value(value)


def test_deep_nesting_is_refused():
    v = []
    for _ in range(100):
        v = [v]
    with pytest.raises(NotPlainData):
        encode_value(v)


@pytest.mark.parametrize("got,exp,same", [
    (1, 1, True), (True, 1, False), (1, True, False), (1.0, 1, False), (1, 1.0, False),
    (0.1 + 0.2, 0.3, True), (1.0001, 1.0, False), ([1, 2], (1, 2), False), ((1, 2), (1, 2), True),
    ({1, 2}, {2, 1}, True), ({1, 2}, frozenset({1, 2}), False), ({True}, {1}, False),
    ({"a": 1}, {"a": 1}, True), ({"a": 1}, {"a": True}, False), ({1: "x"}, {1.0: "x"}, False),
    ([1.0, [2.0]], [1.0, [2.0000000001]], True), (float("nan"), float("nan"), False), ("a", b"a", False),
])
def test_strict_equal(got, exp, same):
    assert strict_equal(got, exp) is same


def _case(src: str) -> TestCase:
    return parse_tests([src], "f.jsonl:1")[0]


def test_accepted_forms():
    c = _case("assert f(1, [2], k=(3,)) == {'a': -1}")
    assert (c.name, c.args, c.kwargs, c.expected, c.kind) == ("f", (1, [2]), {"k": (3,)}, {"a": -1}, "eq")
    assert _case("assert f() is True").expected is True
    c = _case("assert math.isclose(f(2), 1.41, rel_tol=0.01)")
    assert c.kind == "close" and matches(c, 1.414) and not matches(c, 1.5) and not matches(c, True)
    c = _case("assert abs(f(2) - 3.0) < 0.5")
    assert c.kind == "abs_lt" and matches(c, 3) and matches(c, 3.4) and not matches(c, 3.5)
    assert len(parse_tests("assert f(1) == 1\nassert f(2) == 2\n", "x")) == 2
    assert parse_tests(["assert f(1) == 1"], "x")[0].wire_call() == ["f", {"list": [1]}, {"dict": []}]


@pytest.mark.parametrize("src", ["assert f(1)", "assert not f(1)", "assert f(1) != 2", "assert f(x) == 1",
                                 "assert g.f(1) == 1", "assert f(*a) == 1", "assert f(1) == 1 and f(2) == 2",
                                 "assert f(1) == [i for i in range(3)]", "assert f(1) == 1j",
                                 "assert f(1) in (1, 2)", "f(1)", "assert abs(f(1) - 1) < x"])
def test_refused_forms(src):
    with pytest.raises(ValueError, match=r"^f\.jsonl:1: test 1 "):
        parse_tests([src], "f.jsonl:1")


def test_channel_violations_score_zero():
    cases = [TestCase("f", (1,), expected=2), TestCase("f", (2,), expected=4)]
    good = b'{"load": true}\n{"i": 0, "v": 2}\n{"i": 1, "v": 4}\n'
    assert score(cases, read_channel(good, 2)) == 1.0
    for bad in (good + b'{"i": 1, "v": 4}\n',  # duplicate
                b'{"i": 0, "v": 2}\n' + good,  # before load
                good.replace(b'"i": 1', b'"i": 5'),  # unknown call
                good + b"garbage\n",
                good.replace(b'{"i": 1, "v": 4}', b'{"i": 1, "v": {"weird": 4}}'),
                b'{"load": true}\n{"load": true}\n' + good[15:]):
        out = read_channel(bad, 2)
        assert out.error is not None and score(cases, out) == 0.0, bad
    partial = read_channel(b'{"load": true}\n{"i": 0, "v": 2}\n', 2)
    assert score(cases, partial) == 0.0 and score(cases, partial, "fraction") == 0.5
    assert score(cases, Outcome(loaded=False)) == 0.0
    with pytest.raises(ValueError):
        score(cases, partial, "most")


def test_expected_values_are_parsed_not_evaluated():
    # a side-effecting expression is not a literal: refused, never run
    with pytest.raises(ValueError):
        parse_tests(["assert f(1) == __import__('os').system('true')"], "x")
    tree = ast.parse("assert f(1) == (1, {2: [3.5]})")
    assert _case(ast.unparse(tree.body[0])).expected == (1, {2: [3.5]})
