"""Code-execution rewards: runaway programs give reward 0 within the limit and leave nothing running;
the shipped MBPP+-style file passes with its reference solutions; malformed task files name file:line."""

from __future__ import annotations

import json
import time

import pytest

from megaloop.rl.sandbox import (CodeExecutionReward, CodeTask, DATA_DIR, SandboxLimits, extract_code,
                                 run_sandboxed, session_processes)
from megaloop.rl.tasks import Example, make_task

LIMITS = SandboxLimits(timeout_s=2.0, cpu_s=4)  # the wall clock fires first


def _outside_target(tmp_path):
    d = tmp_path / "owned"
    d.mkdir()
    return d / "escaped.txt"


@pytest.mark.parametrize("guard", [True, False], ids=["guarded", "rlimits-only"])
@pytest.mark.parametrize("name,code", [
    ("infinite_loop", "while True:\n    pass\n"),
    ("fork_loop", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"),
    ("huge_allocation", "x = bytearray(8 * 2**30)\n"),
    ("write_outside", "open(TARGET, 'w').write('x')\n"),
    ("syntax_error", "def f(:\n    return 1\n"),
])
def test_runaway_programs_get_zero_and_leave_nothing(tmp_path, name, code, guard):
    target = _outside_target(tmp_path)
    code = code.replace("TARGET", repr(str(target)))
    lim = SandboxLimits(timeout_s=LIMITS.timeout_s, cpu_s=LIMITS.cpu_s, guard=guard)
    t0 = time.monotonic()
    res = run_sandboxed(code, lim)
    elapsed = time.monotonic() - t0
    assert not res.passed
    assert elapsed < lim.timeout_s + 3.0, elapsed  # the limit plus the kill/cleanup grace
    assert res.pid > 0 and session_processes(res.pid) == []
    assert not target.exists()
    if name == "infinite_loop":
        assert res.timed_out
    if name == "syntax_error":
        assert "SyntaxError" in res.stderr
    if name in ("syntax_error", "huge_allocation"):
        assert CodeExecutionReward(lim)(Example("", ""), code) == 0.0


def test_forked_children_are_all_killed():
    """Rlimits-only run: children that outlive their parent are killed with the session."""
    code = ("import os, time\n"
            "for _ in range(4):\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(60)\n"
            "        os._exit(0)\n"
            "time.sleep(60)\n")
    res = run_sandboxed(code, SandboxLimits(timeout_s=1.5, guard=False))
    assert res.timed_out and not res.passed
    assert res.pid and session_processes(res.pid) == []


def test_environment_is_minimal_and_cwd_private(monkeypatch):
    monkeypatch.setenv("MEGALOOP_SECRET_TOKEN", "hunter2")
    code = ("import os, sys\n"
            "assert 'MEGALOOP_SECRET_TOKEN' not in os.environ, os.environ\n"
            "assert set(os.environ) <= {'PATH', 'HOME', 'TMPDIR', 'LANG', 'PYTHONHASHSEED', 'PYTHONDONTWRITEBYTECODE', 'LC_CTYPE'}, os.environ\n"
            "assert os.getcwd().split('/')[-1].startswith('megaloop-sandbox-')\n"
            "assert sys.flags.isolated and sys.flags.no_site\n"
            "open('scratch.txt', 'w').write('ok')\n")
    res = run_sandboxed(code, LIMITS)
    assert res.passed, res.stderr
    assert res.isolation in ("nobody+rlimits", "rlimits")


def test_shipped_task_file_reference_solutions_pass():
    task = make_task("mbpp:tiny")
    assert isinstance(task, CodeTask) and len(task.examples) >= 5
    records = [json.loads(l) for l in (DATA_DIR / "mbpp_tiny.jsonl").read_text().splitlines() if l.strip()]
    for ex, rec in zip(task.examples, records):
        assert task.reward(ex, rec["canonical"]) == 1.0, rec["task_id"]
        assert task.reward(ex, "    return None\n") == 0.0
    ex = task.examples[0]
    assert task.reward(ex, "```python\n    return a + b\n```\nexplanation") == 1.0
    assert extract_code("no fence") == "no fence"


@pytest.mark.parametrize("line,msg", [
    ('{"prompt": "def f():\\n", "tests": ["assert f() == 1"]}\n{"prompt": "x"', ":2: not a JSON record"),
    ('{"prompt": "def f():\\n"}', ":1: missing key(s) 'tests'"),
    ('{"prompt": "def f():\\n", "tests": ["assert (("]}', ":1: 'tests' is not valid Python"),
    ('[1, 2]', ":1: a record must be a JSON object"),
])
def test_malformed_task_file_names_file_and_line(tmp_path, line, msg):
    path = tmp_path / "tasks.jsonl"
    path.write_text(line)
    with pytest.raises(ValueError) as err:
        make_task(f"mbpp:{path}")
    assert str(err.value).startswith(str(path)) and msg in str(err.value)


def test_cli_malformed_task_file_exits_2(tmp_path, capsys):
    from megaloop.rl.cli import main

    path = tmp_path / "tasks.jsonl"
    path.write_text('{"prompt": "p", "answer": "1"}\n{oops\n')
    assert main(["--model", "unused", "--out", str(tmp_path / "o"), "--task", f"exact:{path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path}:2: not a JSON record" in err[0]
