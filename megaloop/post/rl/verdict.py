"""Test cases of an MBPP+-style task, parsed in the trusted parent, and the type-strict verdict.

A task's ``tests`` are assert statements; each must have one of these forms, where ``f(...)`` is
a call of a plain name with literal arguments only (``ast.literal_eval``: numbers, strings,
bytes, ``True``/``False``/``None``, tuples, lists, dicts, sets; positional and keyword):

* ``assert f(...) == EXPECTED`` — EXPECTED a literal; compared with :func:`strict_equal`;
* ``assert f(...) is True`` / ``is False`` / ``is None``;
* ``assert math.isclose(f(...), NUMBER[, rel_tol=R][, abs_tol=A])`` (``isclose(...)`` too);
* ``assert abs(f(...) - NUMBER) < TOL`` (or ``<=``).

Anything else (``assert f(x)``, ``assert not f(x)``, a computed expected value, a nested call,
other statements) is refused when the task file is loaded, naming ``file:line`` and the test.
Only ``(name, args, kwargs)`` of each call go into the sandbox; the expected values stay here.

Type-strict equality (:func:`strict_equal`), as EvalPlus does for MBPP+, with Python's own
distinctions made strict: the returned value must have exactly the expected type at every level —
``bool`` is not ``int`` (``True != 1``), ``int`` is not ``float`` (``5 != 5.0``), ``tuple`` is
not ``list``; ``set``/``frozenset`` and ``dict`` compare order-free with strict elements; a float
matches an expected float when ``math.isclose(got, exp, rel_tol=1e-7, abs_tol=1e-6)`` (EvalPlus's
default tolerances; NaN matches nothing). The tolerance forms (``isclose``, ``abs(...) < tol``)
accept an ``int`` or ``float`` result (not ``bool``) with the stated tolerance.

Reward of one completion (:func:`score`): ``"all"`` (default) — 1.0 when every test matches,
else 0.0; ``"fraction"`` — the share of tests that match. A run whose result channel is
malformed (a duplicate or unknown call index, a line that is not wire format) scores 0.

Everything here that touches a value the program returned is total and bounded, because the
program chooses it: decoding raises only ``ValueError`` (a channel error, see
:func:`~megaloop.post.rl.sandbox_harness.decode_value`); :func:`matches` answers False where Python
itself would raise (``math.isclose(10**400, 3.14)`` is an ``OverflowError``), so such a value fails
its test instead of stopping the trainer; and :func:`strict_equal` compares sizes before hashing
anything, so the work is bounded by the size of the (trusted) expected value.
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass, field

from megaloop.errors import UserError
from megaloop.post.rl.sandbox_harness import NotPlainData, WireError, decode_value, encode_value

REL_TOL = 1e-7  # EvalPlus's rtol for float outputs
ABS_TOL = 1e-6  # EvalPlus's default atol for float outputs
REWARD_MODES = ("all", "fraction")
_FORMS = ("`assert f(args) == expected`, `assert f(args) is True|False|None`, "
          "`assert math.isclose(f(args), x)` or `assert abs(f(args) - x) < tol`, with literal args")


class TestFormatError(UserError, ValueError):
    """A test that is not one of the accepted assert forms."""


@dataclass(frozen=True)
class TestCase:
    """One test: call ``name(*args, **kwargs)`` in the sandbox, compare with ``expected`` here."""

    name: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    expected: object = None
    kind: str = "eq"  # eq | close | abs_lt | abs_le
    rel_tol: float = 0.0
    abs_tol: float = 0.0
    source: str = ""

    __test__ = False  # not a pytest class

    def wire_call(self) -> list:
        return [self.name, encode_value(list(self.args)), encode_value(dict(self.kwargs))]


def _literal(node: ast.AST, what: str):
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise TestFormatError(f"{what} is not a literal") from None
    try:
        # the round trip the value makes over the result channel: refuses at load time what the
        # parent would refuse from an honest program (e.g. a set of > MAX_SAME_HASH alike hashes)
        decode_value(json.loads(json.dumps(encode_value(value), allow_nan=False)))
    except (NotPlainData, WireError) as err:
        raise TestFormatError(f"{what} is not plain data ({err})") from None
    except (ValueError, RecursionError):  # json: an int too long to print, nesting too deep
        raise TestFormatError(f"{what} is not plain data (too large or too deep)") from None
    return value


def _call(node: ast.AST) -> tuple[str, tuple, dict]:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise TestFormatError("the tested expression must be a call `f(args)` of a plain name")
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        raise TestFormatError("*args / **kwargs are not allowed in a test call")
    args = tuple(_literal(a, "an argument") for a in node.args)
    kwargs = {k.arg: _literal(k.value, f"argument {k.arg!r}") for k in node.keywords}
    return node.func.id, args, kwargs


def _number(node: ast.AST, what: str) -> float:
    v = _literal(node, what)
    if type(v) not in (int, float):
        raise TestFormatError(f"{what} must be a number")
    return float(v)


def parse_assert(stmt: ast.stmt, source: str = "") -> TestCase:
    """The :class:`TestCase` of one ``assert`` statement, or :class:`TestFormatError`."""
    if not isinstance(stmt, ast.Assert):
        raise TestFormatError(f"not an assert statement ({type(stmt).__name__})")
    t = stmt.test
    if isinstance(t, ast.Compare) and len(t.ops) == 1:
        op, right = t.ops[0], t.comparators[0]
        if isinstance(op, ast.Eq) and isinstance(t.left, ast.Call):
            name, args, kwargs = _call(t.left)
            return TestCase(name, args, kwargs, _literal(right, "the expected value"), "eq", source=source)
        if isinstance(op, ast.Is) and isinstance(right, ast.Constant) and right.value in (True, False, None) \
                and type(right.value) in (bool, type(None)):
            name, args, kwargs = _call(t.left)
            return TestCase(name, args, kwargs, right.value, "eq", source=source)
        if isinstance(op, (ast.Lt, ast.LtE)) and isinstance(t.left, ast.Call) and \
                isinstance(t.left.func, ast.Name) and t.left.func.id == "abs" and len(t.left.args) == 1 and \
                not t.left.keywords and isinstance(t.left.args[0], ast.BinOp) and \
                isinstance(t.left.args[0].op, ast.Sub):
            diff = t.left.args[0]
            name, args, kwargs = _call(diff.left)
            tol = _number(right, "the tolerance")
            return TestCase(name, args, kwargs, _number(diff.right, "the expected value"),
                            "abs_lt" if isinstance(op, ast.Lt) else "abs_le", abs_tol=tol, source=source)
    if isinstance(t, ast.Call) and len(t.args) == 2 and (
            (isinstance(t.func, ast.Attribute) and t.func.attr == "isclose" and isinstance(t.func.value, ast.Name)
             and t.func.value.id == "math") or (isinstance(t.func, ast.Name) and t.func.id == "isclose")):
        name, args, kwargs = _call(t.args[0])
        tols = {"rel_tol": 1e-9, "abs_tol": 0.0}  # math.isclose's defaults
        for k in t.keywords:
            if k.arg not in tols:
                raise TestFormatError(f"math.isclose takes rel_tol/abs_tol, not {k.arg!r}")
            tols[k.arg] = _number(k.value, k.arg)
        return TestCase(name, args, kwargs, _number(t.args[1], "the expected value"), "close", **tols,
                        source=source)
    raise TestFormatError("unsupported assert form")


def parse_tests(tests: str | list, where: str) -> list[TestCase]:
    """Test cases of one record (``where`` = ``file:line`` for errors)."""
    chunks = tests if isinstance(tests, list) else [tests]
    cases: list[TestCase] = []
    for chunk in chunks:
        try:
            tree = ast.parse(chunk)
        except SyntaxError as err:
            raise ValueError(f"{where}: 'tests' is not valid Python ({err.msg})") from None
        for stmt in tree.body:
            text = ast.get_source_segment(chunk, stmt) or ""
            try:
                cases.append(parse_assert(stmt, text))
            except TestFormatError as err:
                raise ValueError(f"{where}: test {len(cases) + 1} {text[:80]!r}: {err}; accepted forms: "
                                 f"{_FORMS}") from None
    if not cases:
        raise ValueError(f"{where}: 'tests' has no assert statement")
    return cases


def _canon(v):
    """A hashable, type-tagged key for order-free comparison of set elements / dict keys."""
    t = type(v)
    if t in (tuple, frozenset, list, set):
        inner = tuple(_canon(x) for x in v)
        return (t.__name__, tuple(sorted(inner, key=repr)) if t in (frozenset, set) else inner)
    if t is float and math.isnan(v):
        return ("float", "nan")
    return (t.__name__, v)


def strict_equal(got, exp, rel_tol: float = REL_TOL, abs_tol: float = ABS_TOL) -> bool:
    """Type-strict equality (see the module docstring). ``got`` is untrusted: containers compare
    their sizes first, so no more of ``got`` is canonicalised or hashed than ``exp`` holds."""
    if type(got) is not type(exp):
        return False
    t = type(exp)
    if t is float:
        return math.isclose(got, exp, rel_tol=rel_tol, abs_tol=abs_tol)
    if t in (list, tuple, set, frozenset, dict) and len(got) != len(exp):
        return False
    if t in (list, tuple):
        return all(strict_equal(g, e, rel_tol, abs_tol) for g, e in zip(got, exp))
    if t in (set, frozenset):
        return {_canon(x) for x in got} == {_canon(x) for x in exp}
    if t is dict:
        gk = {_canon(k): k for k in got}
        ek = {_canon(k): k for k in exp}
        return gk.keys() == ek.keys() and all(strict_equal(got[gk[c]], exp[ek[c]], rel_tol, abs_tol) for c in ek)
    return got == exp  # None, bool, int, str, bytes


# What comparing decoded plain data (None, bool, int, float, str, bytes and containers of them) can
# raise: OverflowError (an int beyond float range: ``float(10**400)``, ``10**400 - 4.0``),
# ValueError (``repr`` of an int past ``sys.get_int_max_str_digits()``), RecursionError, TypeError.
# Python itself would raise these in the test's assert, i.e. the test fails: no match.
_COMPARE_ERRORS = (ArithmeticError, ValueError, RecursionError, TypeError)


def matches(case: TestCase, got) -> bool:
    """Whether the value returned for ``case`` passes it; False (never an exception) for a value
    that cannot be compared (see :data:`_COMPARE_ERRORS`)."""
    try:
        return _matches(case, got)
    except _COMPARE_ERRORS:
        return False


def _matches(case: TestCase, got) -> bool:
    if case.kind == "eq":
        return strict_equal(got, case.expected)
    if type(got) not in (int, float) or (type(got) is float and not math.isfinite(got)):
        return False
    if type(got) is int:
        got = float(got)  # OverflowError past ~1.8e308, as in Python's own isclose / abs(x - y)
    if case.kind == "close":
        return math.isclose(got, case.expected, rel_tol=case.rel_tol, abs_tol=case.abs_tol)
    diff = abs(got - case.expected)
    return diff < case.abs_tol if case.kind == "abs_lt" else diff <= case.abs_tol


@dataclass
class Outcome:
    """What the result channel of one run said: ``loaded`` and, per call, a value or None."""

    loaded: bool = False
    values: dict = field(default_factory=dict)  # call index -> ("value", v) | ("exc", name)
    error: str | None = None  # protocol violation: the run scores 0


def read_channel(data: bytes, n_calls: int) -> Outcome:
    """Parse the result channel; any malformed line, duplicate or unknown index is a violation."""
    out = Outcome()
    for n, line in enumerate(data.split(b"\n")):
        if not line:
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            out.error = f"line {n + 1}: not JSON"
            return out
        if type(rec) is not dict:
            out.error = f"line {n + 1}: not an object"
            return out
        if set(rec) in ({"load"}, {"load", "exc"}) and type(rec["load"]) is bool:
            if out.loaded or n != 0:
                out.error = "duplicate or late load record"
                return out
            out.loaded = rec["load"]
            continue
        i = rec.get("i")
        if type(i) is not int or not 0 <= i < n_calls or i in out.values or not out.loaded:
            out.error = f"line {n + 1}: bad or repeated call index {i!r}"
            return out
        if set(rec) == {"i", "v"}:
            try:
                out.values[i] = ("value", decode_value(rec["v"]))
            except WireError as err:  # decode_value raises nothing else on parsed JSON
                out.error = f"line {n + 1}: {err}"
                return out
        elif set(rec) == {"i", "exc"} and type(rec["exc"]) is str:
            out.values[i] = ("exc", rec["exc"][:100])
        else:
            out.error = f"line {n + 1}: unexpected keys"
            return out
    return out


def score(cases: list[TestCase], outcome: Outcome, mode: str = "all") -> float:
    """The reward of one run (see the module docstring)."""
    if mode not in REWARD_MODES:
        raise ValueError(f"reward mode: one of {REWARD_MODES}, got {mode!r}")
    if outcome.error is not None or not outcome.loaded or not cases:
        return 0.0
    passed = sum(1 for i, c in enumerate(cases)
                 if outcome.values.get(i, ("exc", ""))[0] == "value" and matches(c, outcome.values[i][1]))
    if mode == "fraction":
        return passed / len(cases)
    return 1.0 if passed == len(cases) else 0.0
