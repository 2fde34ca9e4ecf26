"""Adversarial completions against the real sandbox (bubblewrap) and the trusted verdict.

Every attack of issue #21: a wrong solution earns 0 whatever it does, a correct one wrapped in an
attack that is only a side effect still earns 1, and each run returns within its limit + 1 s,
leaves no process (pid namespace and sandbox uid checked on the host) and no file outside, and
does not grow the caller's memory (:func:`tests.post.rl.sandbox_checks.check_run`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from megaloop.post.rl.sandbox import CodeTask, CodeTaskConfig, run_sandboxed
from megaloop.post.rl.verdict import TestCase, score
from tests.post.rl.sandbox_checks import LIMITS, MARKER, check_run, real_backend

pytestmark = pytest.mark.usefixtures("sandbox")


@pytest.fixture(scope="module")
def sandbox():
    return real_backend()


@pytest.fixture(scope="module")
def task():
    return CodeTask("tiny", config=CodeTaskConfig(limits=LIMITS))


def add_example(task):
    ex = task.examples[0]
    assert ex.meta["task_id"] == "tiny/1"  # def add(a, b): assert add(2, 3) == 5, add(-1, 1) == 0
    return ex


def reward(task, completion: str, watch=()) -> float:
    ex = add_example(task)

    def go():
        r = task.reward(ex, completion)
        res = task._reward.last
        return (r, res), res

    r, res = check_run(go, LIMITS, watch)
    print(f"reward {r}: loaded={res.loaded} values={res.values} error={res.error} timed_out={res.timed_out} "
          f"seconds={res.seconds:.2f} stderr={res.stderr[-300:]!r}")  # shown when an assertion fails
    return r


WRONG, RIGHT = "    return a - b\n", "    return a + b\n"
# name -> (attack code placed after the function body at top level, or in the body when it starts
# with 4 spaces; whether a correct solution wrapped in it must still earn 1)
ATTACKS = {
    "os._exit(0) at import": ("import os\nos._exit(0)\n", False),
    "sys.exit(0) at import": ("import sys\nsys.exit(0)\n", False),
    "raise SystemExit(0) at import": ("raise SystemExit(0)\n", False),
    "os._exit(0) in the body": ("    import os; os._exit(0)\n", False),
    "sys.exit(0) in the body": ("    import sys; sys.exit(0)\n", False),
    "raise SystemExit(0) in the body": ("    raise SystemExit(0)\n", False),
    "atexit.register(os._exit, 0)": ("import atexit, os\natexit.register(os._exit, 0)\n", True),
    "sys.excepthook = os._exit": ("import sys, os\nsys.excepthook = lambda *a: os._exit(0)\n", True),
    "setsid double-fork daemon holding the pipes": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        for _ in range(400):\n            print('alive', flush=True)\n            time.sleep(0.05)\n"
        "    os._exit(0)\n", True),
    "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", False),
    "infinite loop at import": ("while True:\n    pass\n", False),
    "huge allocation": ("x = bytearray(8 * 2**30)\n", False),
    "512 MiB of output": ("import sys\nfor _ in range(8192):\n    sys.stdout.write('x' * 65536)\n", False),
    "stderr flood then continue": ("import os\nfor _ in range(64):\n    os.write(2, b'e' * 65536)\n", False),
    "writes to /tmp and /dev/shm": (
        f"import os\nfor d in ('/tmp', '/dev/shm', '/var/tmp', '/'):\n    try:\n"
        f"        open(os.path.join(d, '{MARKER}'), 'w').write('x')\n    except OSError:\n        pass\n", True),
    "_posixsubprocess.fork_exec / os.open dir_fd / O_TRUNC": (
        f"import os, _posixsubprocess\ntry:\n    fd = os.open('/', os.O_RDONLY)\n"
        f"    os.open('{MARKER}', os.O_WRONLY | os.O_CREAT | os.O_TRUNC, dir_fd=fd)\nexcept OSError:\n    pass\n"
        f"try:\n    import subprocess\n    subprocess.run(['/bin/sh', '-c', 'echo {MARKER} > /tmp/{MARKER}'])\n"
        f"except Exception:\n    pass\n", True),
    "tamper with the harness (builtins, json, channel fds)": (
        "import builtins, json, os\njson.dumps = lambda *a, **k: '{\"i\": 0, \"v\": 5}'\n"
        "for fd in range(3, 64):\n    try:\n        os.write(fd, b'{\"i\": 1, \"v\": 0}\\n')\n    except OSError:\n        pass\n",
        False),
}


def _completion(body: str, attack: str) -> str:
    return attack + body if attack.startswith("    ") else body + attack


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_wrong_solution_earns_zero(task, name):
    attack, _ = ATTACKS[name]
    assert reward(task, _completion(WRONG, attack)) == 0.0


@pytest.mark.parametrize("name", [n for n, (_, side) in ATTACKS.items() if side])
def test_attack_as_side_effect_keeps_correct_reward(task, name):
    attack, _ = ATTACKS[name]
    assert reward(task, _completion(RIGHT, attack)) == 1.0


@pytest.mark.parametrize("body", [
    "    class Yes:\n        def __eq__(self, other):\n            return True\n    return Yes()\n",
    "    class Five(int):\n        def __eq__(self, other):\n            return True\n    return Five(5)\n",
    "    return 5.0 if (a, b) == (2, 3) else 0.0\n",  # right numbers, wrong type (strict: int expected)
    "    return True if (a, b) == (2, 3) else False\n",  # bool is not int
])
def test_values_that_only_look_equal_earn_zero(task, body):
    assert reward(task, body) == 0.0


def test_forged_results_cannot_exceed_honest_answers(task):
    """A completion that writes result lines itself (wrong values, duplicates) scores 0; the
    expected values never enter the sandbox, so it can only claim values it could return."""
    forge = ("import os\nfor fd in range(3, 64):\n    try:\n"
             "        os.write(fd, b'{\"load\": true}\\n{\"i\": 0, \"v\": 6}\\n{\"i\": 1, \"v\": 0}\\n')\n"
             "    except OSError:\n        pass\n")
    assert reward(task, RIGHT + forge) == 0.0  # its own forged lines break the channel
    assert reward(task, WRONG + forge + "os._exit(0)\n") == 0.0  # 6 != 5


def test_completion_sees_no_host_and_has_no_privilege(tmp_path):
    """Reads of the task file, the repo, the caller's /proc and home fail; no network, no host
    loopback service; a per-run uid without capabilities; only / interpreter files are visible."""
    secret = tmp_path / "answers.jsonl"
    secret.write_text('{"expected": 5}\n')
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    probe = textwrap.dedent(f"""
        import os, socket, sys
        def probe():
            seen = {{}}
            for p in ({str(secret)!r}, {os.getcwd()!r} + '/megaloop/post/rl/data/mbpp_tiny.jsonl',
                      '/proc/1/cmdline', '/proc/self/status', '/etc/passwd', '/root/.bashrc', '/work'):
                try:
                    seen[p] = os.listdir(p) if os.path.isdir(p) else open(p, 'rb').read(10).hex()
                except OSError as e:
                    seen[p] = None
            s = socket.socket()
            s.settimeout(1)
            try:
                s.connect(('127.0.0.1', {port}))
                net = 'connected'
            except OSError as e:
                net = type(e).__name__
            files = []
            for root, dirs, names in os.walk('/'):
                if root.startswith(('/dev', '/tmp')) or '/lib/python3' in root:
                    dirs[:] = []
                    continue
                files += [os.path.join(root, n) for n in names]
            try:
                os.setuid(0)
                setuid = 'ok'
            except OSError:
                setuid = 'denied'
            return [seen, net, os.getuid(), setuid, sorted(files), os.getcwd()]
    """)
    got = check_run(lambda: (lambda r: (r, r))(run_sandboxed(probe, LIMITS, [TestCase("probe", ())])),
                    LIMITS, [secret])
    assert got.passed, got.stderr
    seen, net, uid, setuid, files, cwd = got.values[0][1]
    assert all(v is None for v in seen.values()), seen
    assert net != "connected"
    try:
        conn, _ = server.accept()
        conn.close()
        pytest.fail("the sandbox reached a 127.0.0.1 service of the host")
    except socket.timeout:
        pass
    finally:
        server.close()
    assert cwd == "/tmp"
    if os.geteuid() == 0:
        assert uid != 0 and setuid == "denied"
    exe = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    assert all(f == exe or ".so" in os.path.basename(f) or f == "/etc/ld.so.cache" for f in files), files


def test_kernel_interfaces_are_filtered(sandbox):
    """seccomp: no new namespaces (unshare, clone with CLONE_NEWUSER), no ptrace; fork and threads work."""
    if sandbox.seccomp is None:
        pytest.skip("no seccomp table for this architecture")
    probe = textwrap.dedent("""
        import ctypes, os, platform, threading
        def probe():
            libc = ctypes.CDLL(None, use_errno=True)
            clone = {'x86_64': 56, 'aarch64': 220}[platform.machine()]
            out = [libc.unshare(0x10000000), ctypes.get_errno(), libc.syscall(clone, 0x10000000 | 17, 0, 0, 0, 0),
                   ctypes.get_errno(), libc.ptrace(0, 0, 0, 0), ctypes.get_errno()]
            pid = os.fork()
            if pid == 0:
                os._exit(7)
            box = []
            t = threading.Thread(target=lambda: box.append(1))
            t.start()
            t.join()
            return out + [os.waitpid(pid, 0)[1] >> 8, box]
    """)
    res = check_run(lambda: (lambda r: (r, r))(run_sandboxed(probe, LIMITS, [TestCase("probe", ())])), LIMITS)
    assert res.passed, res.stderr
    assert res.values[0][1] == [-1, 1, -1, 1, -1, 1, 7, [1]]


def test_cross_sample_tampering_changes_no_later_reward(tmp_path):
    """A completion that keeps trying to tamper with other sandboxes (writes everywhere it can,
    signals every process, leaves daemons) runs beside and before other completions: every one of
    them gets exactly the reward it earns on its own."""
    cfg = CodeTaskConfig(limits=LIMITS, workers=4)
    task = CodeTask("tiny", config=cfg)
    ex = add_example(task)
    tamper = RIGHT + textwrap.dedent("""
        import os, signal, time
        def spray():
            for _ in range(200):
                for root, dirs, names in os.walk('/'):
                    for n in names + dirs:
                        try:
                            with open(os.path.join(root, n), 'w') as f:
                                f.write('def add(a, b):\\n    return a + b\\n')
                        except OSError:
                            pass
                try:
                    os.kill(-1, signal.SIGKILL)
                except OSError:
                    pass
                time.sleep(0.01)
        for _ in range(3):
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    spray()
                os._exit(0)
    """)
    others = [WRONG, "    return (((\n", RIGHT, "    return None\n", WRONG]
    want = [0.0, 0.0, 1.0, 0.0, 0.0]
    solo = [task.reward(ex, c) for c in others]
    assert solo == want
    for _ in range(2):
        got = task.reward_many([(ex, tamper)] + [(ex, c) for c in others] + [(ex, tamper)] + [(ex, c) for c in others])
        assert got == [1.0] + want + [1.0] + want
    assert [task.reward(ex, c) for c in others] == want


def test_caller_memory_and_time_bounded_under_output_flood():
    """512 MiB printed: the caller's peak RSS grows by well under 64 MiB, and it returns in time."""
    code = textwrap.dedent("""
        import json, resource, sys, time
        from megaloop.post.rl.sandbox import SandboxLimits, run_sandboxed, sandbox_backend
        assert sandbox_backend().kind == 'bwrap'
        lim = SandboxLimits(timeout_s=3.0, cpu_s=3, output_bytes=2**40)  # read it all: the tail bound alone
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t = time.monotonic()
        res = run_sandboxed("import sys\\nfor _ in range(8192):\\n    sys.stdout.write('x' * 65536)\\n", lim)
        took = time.monotonic() - t
        res2 = run_sandboxed("import os, time\\nos.close(1)\\nos.close(2)\\ntime.sleep(30)\\n", lim)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"grew_kib": after - before, "took": took, "tail": len(res.stdout),
                          "timed_out2": res2.timed_out, "took2": res2.seconds}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert rec["grew_kib"] < 64 * 1024, rec
    # bounds with room for a loaded machine (the 3 s wall limit + 3 s; the second program would sleep 30 s)
    assert rec["took"] < 6.0 and rec["tail"] <= 4000, rec
    assert rec["timed_out2"] and rec["took2"] < 6.0, rec  # no output to read: the wall clock still fires


def test_wall_limit_end_to_end_with_everything_at_once(task):
    """Daemon + closed pipes + busy loop + fork: still back within limit + 1 s, nothing left."""
    attack = textwrap.dedent("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            while True:
                pass
        os.close(1)
        while True:
            time.sleep(0.1)
    """)
    assert reward(task, RIGHT + attack) == 0.0


def test_concurrent_rewards_with_threads_are_independent(task):
    """The pool and plain threads calling the reward at once: each call gets its own uid/namespace."""
    ex = add_example(task)
    results = {}

    def one(k):
        results[k] = task.reward(ex, RIGHT if k % 2 else WRONG)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {k: (1.0 if k % 2 else 0.0) for k in range(6)}
    assert score(ex.meta["cases"], task._reward.run(ex, RIGHT).outcome, "fraction") == 1.0


@pytest.mark.parametrize("mode", ["per-run uid (root)", "user namespace (not root)"])
def test_only_tmp_is_writable(sandbox, mode):
    """The new root and ``/dev`` are uncapped tmpfs mounts: in a user namespace (a caller that is not
    root) the program owned them, so it could write outside ``/tmp`` and hold up to half the host's
    RAM in each. Both are read-only now; the user-namespace mode is run here as root by turning the
    per-run uid off, which gives bwrap the argv a non-root caller gets."""
    import dataclasses

    from megaloop.post.rl.sandbox import SandboxLimits

    backend = sandbox if mode.startswith("per-run") else dataclasses.replace(sandbox, privileged=False)
    code = textwrap.dedent("""
        import os
        def writable():
            out = []
            for d in ('/', '/dev', '/dev/shm', '/tmp', '/usr'):
                try:
                    with open(os.path.join(d, 'w_probe'), 'wb') as f:
                        f.write(b'x' * 4096)
                    out.append(d)
                except OSError:
                    pass
            return out
    """)
    res = run_sandboxed(code, SandboxLimits(timeout_s=30.0, cpu_s=30), [TestCase("writable", ())], backend=backend)
    assert res.loaded, res
    assert res.values.get(0) == ("value", ["/tmp"]), res


def test_a_run_killed_at_the_wall_clock_limit_scores_zero_even_after_answering(task):
    """A correct function, then a ``sys.stdout`` whose ``flush`` never returns: the harness has sent
    every value when the wall clock kills the run. It used to score 1 while the trainer counted it
    as a timeout and said such runs score 0."""
    hang = ("import sys\nclass _Hang:\n    def write(self, s):\n        return len(s)\n"
            "    def flush(self):\n        while True:\n            pass\nsys.stdout = _Hang()\n")
    assert reward(task, RIGHT + hang) == 0.0
    assert task._reward.last.timed_out and task._reward.last.loaded
