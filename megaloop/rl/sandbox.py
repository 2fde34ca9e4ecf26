"""Code-execution rewards (the paper's MBPP+ column): run a completion against its tests in a
resource-limited subprocess; reward 1.0 when the program exits 0 within the limits, else 0.0.

What one run gets (:func:`run_sandboxed`):

* a fresh temporary directory as cwd, ``HOME`` and ``TMPDIR`` (removed afterwards);
* a minimal environment (``PATH``, ``LANG``, ``PYTHONHASHSEED``; nothing inherited: no tokens,
  no proxies) and an isolated interpreter (``-I -S``: no user site, no site-packages);
* its own session and process group (``start_new_session``); on a wall-clock timeout, or when
  the program ends, the whole group is killed (``SIGKILL``) — no child survives the call;
* rlimits set before ``exec``: CPU seconds, address space, file size, processes, open files,
  no core dumps;
* when the caller is root: the program runs as ``nobody`` (so ``RLIMIT_NPROC`` is enforced and
  files the caller owns are read-only to it), provided an interpreter reachable by ``nobody``
  exists (else it stays root, reported as ``isolation="rlimits"``);
* an in-interpreter audit hook (Python's ``sys.addaudithook``, which code cannot remove) that
  refuses writes outside the temporary directory, process creation (``fork``, ``exec``,
  ``subprocess``, ``os.system``), ``ctypes`` and sockets.

This is a resource limiter, **not a security boundary** like a container or a VM: it has no
filesystem/network namespaces, reads are not restricted, and an audit hook is a guard against
accidents, not against an adversary. Run untrusted model output at scale inside a container.

Task file (``mbpp:PATH.jsonl``; ``mbpp:tiny`` = the shipped ``megaloop/rl/data/mbpp_tiny.jsonl``):
one JSON object per line with ``prompt`` (the text the model continues), ``tests`` (a list of
assert statements, or one string of test code) and optionally ``setup`` (code placed before the
completion, e.g. imports) and ``task_id``. The program run is ``setup + completion + tests``.
"""

from __future__ import annotations

import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megaloop.rl.tasks import Example, read_jsonl

DATA_DIR = Path(__file__).resolve().parent / "data"
NOBODY = 65534

# Runs first in the child: deny writes outside the cwd, process creation, ctypes and sockets.
_GUARD = r'''
import os as _os, sys as _sys
_root = _os.path.realpath(_os.getcwd())
def _inside(p):
    try:
        p = _os.path.realpath(_os.fsdecode(p) if not isinstance(p, int) else "")
    except Exception:
        return False
    return p == _root or p.startswith(_root + _os.sep)
_DENY = ("os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "subprocess.Popen",
         "ctypes.", "socket.", "os.kill", "os.killpg", "pty.spawn", "_posixsubprocess")
_WRITE = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.truncate",
          "os.chmod", "os.chown", "os.utime", "shutil.rmtree")
def _hook(event, args):
    if event.startswith(_DENY):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and args and not isinstance(args[0], int):
        mode = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        if (any(c in mode for c in "wax+") or flags & (_os.O_WRONLY | _os.O_RDWR | _os.O_CREAT)) and not _inside(args[0]):
            raise PermissionError(f"sandbox: writing {args[0]!r} outside the sandbox directory")
    elif event in _WRITE and args and not all(_inside(a) for a in args[:2] if isinstance(a, (str, bytes))):
        raise PermissionError(f"sandbox: {event} outside the sandbox directory")
_sys.addaudithook(_hook)
del _hook
_src = open("solution.py").read()
exec(compile(_src, "solution.py", "exec"), {"__name__": "__main__"})
'''


@dataclass
class SandboxLimits:
    """Per-run limits (seconds, bytes, counts)."""

    timeout_s: float = 5.0  # wall clock
    cpu_s: int = 5
    memory_bytes: int = 512 * 2**20  # address space
    file_bytes: int = 2**20  # largest file the program may write
    processes: int = 16  # RLIMIT_NPROC (of the sandbox user)
    open_files: int = 64
    guard: bool = True  # the audit-hook guard (off only to test the rlimits/kill path alone)

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_bytes", "file_bytes", "processes", "open_files"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass
class SandboxResult:
    passed: bool
    returncode: int | None
    timed_out: bool
    seconds: float
    stdout: str
    stderr: str
    isolation: str  # "nobody+rlimits" | "rlimits"
    pid: int = 0  # the program's pid = its session and process-group id


def _reachable_by_others(path: str) -> bool:
    """Every directory on the way is o+x and the file o+x (so ``nobody`` can exec it)."""
    p = Path(path).resolve()
    if not p.is_file() or not os.stat(p).st_mode & 0o001:
        return False
    return all(os.stat(d).st_mode & 0o001 for d in p.parents)


def sandbox_interpreter() -> tuple[str, bool]:
    """``(python, drop_privileges)``: as root, an interpreter ``nobody`` can run (then drop to it)."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    if os.geteuid() != 0:
        return base, False
    for cand in (base, shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")):
        if cand and _reachable_by_others(cand):
            return cand, True
    return base, False


def _count_user_processes(uid: int) -> int:
    n = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                n += os.stat(f"/proc/{d}").st_uid == uid
            except OSError:
                pass
    return n


def session_processes(sid: int, zombies: bool = False) -> list[int]:
    """PIDs whose session id is ``sid`` (Linux ``/proc``; exited-but-unreaped ones with ``zombies``)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if len(fields) > 3 and int(fields[3]) == sid and (zombies or fields[0] != "Z"):
            pids.append(int(d))
    return pids


def _kill_session(sid: int, deadline_s: float = 2.0) -> None:
    """SIGKILL the process group and any stragglers of the session, then wait (up to ``deadline_s``)
    until they are reaped too: an unreaped zombie still counts against the user's RLIMIT_NPROC."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            os.killpg(sid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        left = session_processes(sid, zombies=True)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not left or time.monotonic() > end:
            return
        time.sleep(0.02)


def run_sandboxed(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run Python ``code`` in a fresh temp dir under ``limits``; every process it started is gone on return."""
    lim = limits or SandboxLimits()
    python, drop = sandbox_interpreter()
    nproc = lim.processes + (0 if drop else _count_user_processes(os.geteuid()))
    tmp = tempfile.mkdtemp(prefix="megaloop-sandbox-")
    try:
        Path(tmp, "solution.py").write_text(code)
        Path(tmp, "guard.py").write_text(_GUARD if lim.guard else "exec(open('solution.py').read())\n")
        if drop:
            for f in (tmp, *(os.path.join(tmp, n) for n in os.listdir(tmp))):
                os.chown(f, NOBODY, NOBODY)

        def preexec() -> None:  # runs in the child between fork and exec
            resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s + 1))
            resource.setrlimit(resource.RLIMIT_AS, (lim.memory_bytes, lim.memory_bytes))
            resource.setrlimit(resource.RLIMIT_FSIZE, (lim.file_bytes, lim.file_bytes))
            resource.setrlimit(resource.RLIMIT_NOFILE, (lim.open_files, lim.open_files))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if drop:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
               "PYTHONDONTWRITEBYTECODE": "1"}
        t0 = time.monotonic()
        proc = subprocess.Popen([python, "-I", "-S", "guard.py"], cwd=tmp, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=preexec, close_fds=True)
        timed_out = False
        try:
            out, err = proc.communicate(timeout=lim.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            out, err = proc.communicate()  # reaps the program itself
        _kill_session(proc.pid)  # then every process left in its session, reaped
        seconds = time.monotonic() - t0
        rc = proc.returncode
        return SandboxResult(passed=(rc == 0 and not timed_out), returncode=rc, timed_out=timed_out,
                             seconds=seconds, stdout=out.decode(errors="replace")[-4000:],
                             stderr=err.decode(errors="replace")[-4000:],
                             isolation="nobody+rlimits" if drop else "rlimits", pid=proc.pid)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_FENCE = re.compile(r"```(?:python|py)?\n(.*?)(?:```|$)", re.S)


def extract_code(completion: str) -> str:
    """The code of a completion: the first fenced block if there is one, else the text itself."""
    m = _FENCE.search(completion)
    return m.group(1) if m else completion


class CodeExecutionReward:
    """1.0 when ``setup + completion + tests`` exits 0 in :func:`run_sandboxed`, else 0.0."""

    def __init__(self, limits: SandboxLimits | None = None):
        self.limits = limits or SandboxLimits()

    def program(self, example: Example, completion: str) -> str:
        setup = example.meta.get("setup", "")
        tests = example.answer
        return f"{setup}\n{example.meta.get('code_prefix', '')}{extract_code(completion)}\n\n{tests}\n"

    def __call__(self, example: Example, completion: str) -> float:
        return 1.0 if run_sandboxed(self.program(example, completion), self.limits).passed else 0.0


class CodeTask:
    """MBPP+-style records (see the module docstring); ``path="tiny"`` = the shipped sample.

    ``prompt_is_code``: the prompt is a code prefix (a signature + docstring) the completion
    continues, so it is placed before the completion in the program."""

    def __init__(self, path: str | Path, limits: SandboxLimits | None = None, prompt_is_code: bool = True):
        self.path = DATA_DIR / "mbpp_tiny.jsonl" if str(path) == "tiny" else Path(path)
        self.name = "mbpp"
        self.examples: list[Example] = []
        for lineno, rec in read_jsonl(self.path, required=("prompt", "tests")):
            tests = rec["tests"]
            if isinstance(tests, list) and all(isinstance(t, str) for t in tests):
                tests = "\n".join(tests)
            if not isinstance(tests, str) or not tests.strip():
                raise ValueError(f"{self.path}:{lineno}: 'tests' must be a non-empty string or list of strings")
            if not isinstance(rec["prompt"], str) or not rec["prompt"].strip():
                raise ValueError(f"{self.path}:{lineno}: 'prompt' must be a non-empty string")
            try:
                compile(tests, f"{self.path}:{lineno}", "exec")
            except SyntaxError as err:
                raise ValueError(f"{self.path}:{lineno}: 'tests' is not valid Python ({err.msg})") from None
            meta = {"task_id": rec.get("task_id", lineno), "setup": rec.get("setup", ""),
                    "code_prefix": rec["prompt"] if prompt_is_code else ""}
            self.examples.append(Example(rec["prompt"], tests, meta))
        if not self.examples:
            raise ValueError(f"{self.path}: no records")
        self._reward = CodeExecutionReward(limits)

    def sample(self, n: int, rng: random.Random) -> list[Example]:
        return [rng.choice(self.examples) for _ in range(n)]

    def reward(self, example: Example, completion: str) -> float:
        return self._reward(example, completion)
