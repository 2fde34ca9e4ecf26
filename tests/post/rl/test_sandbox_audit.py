"""Regression tests of the sandbox audit: four attacks by a completion on the trusted parent or the
host, each through the public reward API on the real sandbox (bubblewrap), plus fast checks of the
verdict code they went through (no sandbox).

1. a returned int beyond float range against a tolerance test (``math.isclose`` / ``abs(...) < tol``)
   made ``matches`` raise OverflowError out of ``reward_many``;
2. a forged result line with a tagged body of the wrong type (``{"float": [1]}``) made
   ``decode_value`` raise TypeError out of ``reward_many``;
3. a forged ~1 MiB set of ints that all hash alike cost the parent tens of seconds of CPU;
4. SysV shared memory (not charged to RLIMIT_AS) pinned GiBs of host RAM from inside the sandbox.
"""

from __future__ import annotations

import errno
import json
import textwrap
import time

import pytest

from megaloop.post.rl.sandbox import CodeTask, CodeTaskConfig, run_sandboxed
from megaloop.post.rl.sandbox_harness import MAX_SAME_HASH, decode_value
from megaloop.post.rl.verdict import TestCase, matches, parse_tests, read_channel, score
from tests.post.rl.sandbox_checks import LIMITS, check_run, real_backend

P = (1 << 61) - 1  # every multiple of it hashes to 0


@pytest.fixture(scope="module")
def sandbox():
    return real_backend()


def make_task(tmp_path, records: list[dict]) -> CodeTask:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return CodeTask(path, config=CodeTaskConfig(limits=LIMITS))


def forge(lines: bytes) -> str:
    """Completion body (after a ``def``'s first line) that answers ``set()``, then writes ``lines``
    to the result channel itself and exits before the harness does."""
    return ("    return set()\nimport os\n"
            f"os.write(3, b'{{\"load\": true}}\\n' + {lines!r})\nos._exit(0)\n")


# ----------------------------------------------------------------------------- 1: OverflowError
@pytest.mark.parametrize("test,right", [
    ("assert math.isclose(area(1.0), 3.14159, rel_tol=1e-3)", "    return 3.14159\n"),
    ("assert abs(area(1.0) - 4.0) < 1e-6", "    return 4\n"),
    ("assert abs(area(1.0) - 4.0) <= 1e-6", "    return 4.0\n"),
])
def test_int_beyond_float_range_fails_its_test_without_stopping_the_trainer(sandbox, tmp_path, test, right):
    task = make_task(tmp_path, [{"prompt": "import math\ndef area(r):\n", "tests": [test]}])
    ex = task.examples[0]
    assert task.reward_many([(ex, "    return 10**400\n"), (ex, right), (ex, "    return -10**400\n")]) == \
        [0.0, 1.0, 0.0]


def test_matches_is_total_on_huge_ints():
    for src in ("assert math.isclose(f(1), 3.14159, rel_tol=1e-3)", "assert abs(f(1) - 4.0) < 1e-6",
                "assert abs(f(1) - 4.0) <= 1e300", "assert f(1) == 2.0", "assert f(1) == [1.5]"):
        case = parse_tests([src], "t")[0]
        for got in (10**400, -10**400, [10**400], {10**400}):
            assert matches(case, got) is False
    assert matches(parse_tests(["assert abs(f(1) - 4.0) < 1e-6"], "t")[0], 4) is True


# ----------------------------------------------------------------------------- 2: forged line, bad body
@pytest.mark.parametrize("body", [b'{"float": [1]}', b'{"float": {}}', b'{"bytes": 5}'])
def test_forged_line_with_a_malformed_body_scores_zero_without_stopping_the_trainer(sandbox, body):
    task = CodeTask("tiny", config=CodeTaskConfig(limits=LIMITS))
    ex = task.examples[0]  # def add(a, b): tests add(2, 3) == 5, add(-1, 1) == 0
    evil = forge(b'{"i": 0, "v": ' + body + b'}\n').replace("return set()", "return a + b")
    assert task.reward_many([(ex, "    return a + b\n"), (ex, evil)]) == [1.0, 0.0]
    res = task._reward.run(ex, evil)
    assert res.loaded and res.error is not None and score(ex.meta["cases"], res.outcome) == 0.0


@pytest.mark.parametrize("body", [
    '{"float": [1]}', '{"float": {}}', '{"float": "nope"}', '{"bytes": 5}', '{"bytes": "zz"}', '{"bytes": ["00"]}',
    '{"list": {}}', '{"set": "ab"}', '{"set": [{"list": []}]}', '{"frozenset": [{"set": []}]}',
    '{"dict": [[{"list": [1]}, 2]]}', '{"dict": [[1]]}', '{"dict": [1, 2]}', '{"dict": {"a": 1}}',
    '{"tuple": [{"float": [0]}]}', '{"x": 1}', '{}', '[1]', '{"list": [], "tuple": []}',
])
def test_every_malformed_body_is_a_channel_error(body):
    cases = [TestCase("f", (1,), expected=2)]
    out = read_channel(b'{"load": true}\n{"i": 0, "v": ' + body.encode() + b'}\n', 1)
    assert out.error is not None and score(cases, out) == 0.0


# ----------------------------------------------------------------------------- 3: hash collisions
def collision_line(budget: int = 1_000_000) -> bytes:
    items, size = [], 40
    while size < budget:
        s = str(P * (len(items) + 1))
        items.append(s)
        size += len(s) + 1
    return ('{"i": 0, "v": {"set": [' + ",".join(items) + ']}}\n').encode()


def test_set_of_colliding_hashes_costs_the_parent_no_time(sandbox, tmp_path):
    task = make_task(tmp_path, [{"prompt": "def evens(xs):\n", "tests": ["assert evens([1, 2, 4]) == {2, 4}"]}])
    ex = task.examples[0]
    evil = forge(collision_line())
    assert len(evil) > 900_000
    right = "    return {x for x in xs if x % 2 == 0}\n"
    t, cpu = time.monotonic(), time.process_time()
    rewards = task.reward_many([(ex, evil), (ex, right)])
    wall, cpu = time.monotonic() - t, time.process_time() - cpu
    assert rewards == [0.0, 1.0]
    assert cpu < 2.0, f"the parent spent {cpu:.1f} s of CPU on the batch"  # was 10-40 s
    assert wall < 2 * (LIMITS.timeout_s + 1.0), f"the batch took {wall:.1f} s"
    # the parent's own CPU time, not the wall clock: the sandbox's start-up is wall time that a loaded
    # machine stretches (a 3 s wall bound failed in CI at 4.9 s while 4 other jobs shared 2 cores)
    t, cpu = time.monotonic(), time.process_time()
    assert task.reward(ex, evil) == 0.0
    wall, cpu = time.monotonic() - t, time.process_time() - cpu
    assert cpu < 2.0, f"the parent spent {cpu:.1f} s of CPU on one reward"
    assert wall < 2 * (LIMITS.timeout_s + 1.0), f"one reward took {wall:.1f} s"  # bounded, not fast
    assert "share one hash value" in (task._reward.last.error or "")


def test_hash_collisions_are_bounded_when_decoding():
    t = time.process_time()
    out = read_channel(b'{"load": true}\n' + collision_line(), 1)
    assert out.error is not None and "share one hash value" in out.error
    out = read_channel(b'{"load": true}\n' + collision_line().replace(b'"set"', b'"frozenset"'), 1)
    assert out.error is not None
    pairs = ",".join(f"[{P * k}, 0]" for k in range(1, 40_000))
    out = read_channel(b'{"load": true}\n{"i": 0, "v": {"dict": [' + pairs.encode() + b']}}\n', 1)
    assert out.error is not None
    # groups of MAX_SAME_HASH alike hashes are accepted, and still decode in linear time
    group = ",".join(str(h + m * P) for h in range(1, 3_000) for m in range(MAX_SAME_HASH))
    out = read_channel(b'{"load": true}\n{"i": 0, "v": {"set": [' + group.encode() + b']}}\n', 1)
    assert out.error is None and len(out.values[0][1]) == 2_999 * MAX_SAME_HASH
    assert time.process_time() - t < 2.0
    assert decode_value({"set": [P * k for k in range(1, MAX_SAME_HASH + 1)]}) == \
        {P * k for k in range(1, MAX_SAME_HASH + 1)}
    # a test whose value could not come back over the channel is refused when the file is loaded
    with pytest.raises(ValueError, match="not plain data"):
        parse_tests([f"assert f(1) == {{{', '.join(str(P * k) for k in range(1, MAX_SAME_HASH + 2))}}}"], "t")


def test_set_comparison_work_is_bounded_by_the_expected_size():
    case = parse_tests(["assert f(1) == {2, 4}"], "t")[0]
    big = set(range(300_000))
    t = time.process_time()
    assert not matches(case, big) and not matches(case, frozenset(big)) and not matches(case, dict.fromkeys(big))
    assert time.process_time() - t < 0.5


# ----------------------------------------------------------------------------- 4: SysV IPC
SYSV_PROBE = textwrap.dedent("""
    import ctypes
    def probe():
        libc = ctypes.CDLL(None, use_errno=True)
        out = []
        for call in (lambda: libc.shmget(0, 1 << 20, 0o1000 | 0o600), lambda: libc.msgget(0, 0o1000 | 0o600),
                     lambda: libc.semget(0, 1, 0o1000 | 0o600)):
            ctypes.set_errno(0)
            out.append([call(), ctypes.get_errno()])
        return out
""")

SHM_FLOOD = textwrap.dedent("""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype, libc.shmat.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    libc.shmdt.argtypes = [ctypes.c_void_p]
    SEG = 256 * 2**20
    for _ in range(4):  # 1 GiB: twice the address-space limit of the process
        sid = libc.shmget(0, SEG, 0o1000 | 0o600)
        if sid < 0:
            break
        addr = libc.shmat(sid, None, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            break
        ctypes.memset(addr, 1, SEG)
        libc.shmdt(ctypes.c_void_p(addr))
""")


def test_sysv_ipc_is_denied_in_the_sandbox(sandbox):
    if sandbox.seccomp is None:
        pytest.skip("no seccomp table for this architecture")
    res = check_run(lambda: (lambda r: (r, r))(run_sandboxed(SYSV_PROBE, LIMITS, [TestCase("probe", ())])), LIMITS)
    assert res.passed, res.stderr
    assert res.values[0][1] == [[-1, errno.EPERM]] * 3


def test_shm_flood_earns_nothing_and_keeps_a_correct_reward(sandbox, tmp_path):
    task = make_task(tmp_path, [{"prompt": "def f(x):\n", "tests": ["assert f(2) == 4"]}])
    ex = task.examples[0]
    wrong, right = "    return x + 3\n" + SHM_FLOOD, "    return x * 2\n" + SHM_FLOOD
    assert task.reward_many([(ex, wrong), (ex, right)]) == [0.0, 1.0]
