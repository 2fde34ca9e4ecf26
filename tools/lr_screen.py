#!/usr/bin/env python
"""Learning-rate screens (SPEC §11): one short run per LR of a log-spaced grid, select by the
validation CE at depth R=5 on the frozen LR-screen set, and check the optimum is bracketed.

    python tools/lr_screen.py --config S --out runs/screen_S                      # paper range, 7 points
    python tools/lr_screen.py --config tiny --grid 1e-3,3e-3,1e-2 --out runs/scr --stop-after 20
    python tools/lr_screen.py --config L --launcher slurm --wait --screen-set /data/eval/screen \\
        --out runs/screen_L -- data.path=/data/txt360_mds

Each point is ``megaloop train --config C --run-dir OUT/lr_<lr> --resume auto optim.lr=<lr>
train.stop_after=<N> data.val_path=<screen set> train.eval_depth=5 train.eval_batches=<K> ...``:
the config's full ``train.max_steps`` horizon (so the WSD schedule of the full run) is kept and the
run stops after N updates; its last metrics line carries ``val_ce`` at depth 5 on the screen set.

Outputs in OUT: ``results.csv``, ``results.json``, ``screen.png`` (CE vs LR, log x, best marked),
``screen.json`` (the screen's fixed settings), ``launches.jsonl`` (one line per training launch),
``lr_<lr>/`` run directories (``train.log``, ``metrics.jsonl``, ``checkpoints/``, ``screen_exit``).

Resumable: rerunning the same command skips finished points (final step logged with ``val_ce``),
resumes unfinished ones from their latest checkpoint, and keeps diverged ones. A grid extended by a
point reuses every finished run in OUT (the run directories are keyed by LR).

Exit status: 0 screen complete (an edge optimum is reported loudly but is not an error unless
``--fail-on-edge``: 3); 1 some point failed or is unfinished; 2 bad arguments / config.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

EXIT_REQUEUE = 75  # megaloop train: stopped by a signal after writing a checkpoint
WHOLE_SET = 1_000_000  # train.eval_batches when the screen set's size is unknown: evaluate it all

# Per-scale defaults: SPEC §11 ranges; sqrt(2) spacing; stop inside the paper's stop window.
SCALE_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": {"range": (1e-3, 8e-3), "points": 4, "stop_after": 24},  # CPU-sized, a few minutes
    "S": {"range": (0.5e-3, 4e-3), "points": 7, "stop_after": 768},  # paper: 512..1,024
    "M": {"range": (0.25e-3, 4e-3), "points": 9, "stop_after": 4096},  # paper: 2,048..12,288
    "L": {"range": (0.125e-3, 2e-3), "points": 9, "stop_after": 16384},  # paper: 8,192..32,768
}
SCALE_ALIASES = {"untied4": "S", "untied12": "S"}  # baselines with the S model's shapes
RESERVED = ("optim.lr", "train.stop_after", "data.val_path", "train.eval_depth", "train.eval_batches")
FIXED_SETTINGS = ("config", "stop_after", "max_steps", "eval_depth", "eval_batches", "screen_set",
                  "overrides")


class UsageError(Exception):
    """Bad command-line input; the message starts with the argument at fault."""


def log(msg: str) -> None:
    print(f"[lr_screen] {msg}", flush=True)


# ====================================================================================== grid
def lr_tag(lr: float) -> str:
    """Canonical text of a learning rate: used in run-dir names and in ``optim.lr=``."""
    return f"{lr:.6g}"


def _round_sig(x: float, digits: int = 3) -> float:
    return float(f"{x:.{digits}g}")


def log_grid(lo: float, hi: float, points: int) -> list[float]:
    """``points`` log-spaced values from ``lo`` to ``hi`` (inclusive), 3 significant digits."""
    return [_round_sig(lo * (hi / lo) ** (i / (points - 1))) for i in range(points)]


def _number(text: str, arg: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{arg}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise UsageError(f"{arg}: {text!r} is not a finite number")
    return value


def parse_grid(text: str) -> list[float]:
    items = [t.strip() for t in text.split(",")]
    if not any(items):
        raise UsageError("--grid: empty grid; give comma-separated learning rates, e.g. --grid 1e-3,2e-3,4e-3")
    if "" in items:
        raise UsageError(f"--grid: empty entry in {text!r}")
    lrs = [_number(t, "--grid") for t in items]
    bad = [t for t, v in zip(items, lrs) if v <= 0]
    if bad:
        raise UsageError(f"--grid: learning rates must be > 0, got {', '.join(bad)}")
    tags = [lr_tag(v) for v in lrs]
    dups = sorted({t for t in tags if tags.count(t) > 1})
    if dups:
        raise UsageError(f"--grid: duplicate learning rate(s) {', '.join(dups)}")
    if len(lrs) < 3:
        raise UsageError(f"--grid: needs at least 3 learning rates to bracket an optimum, got {len(lrs)}")
    return sorted(lrs)


def parse_range(text: str) -> tuple[float, float]:
    items = [t.strip() for t in text.split(",")]
    if len(items) != 2 or not all(items):
        raise UsageError(f"--range: expected LO,HI (two numbers), got {text!r}")
    lo, hi = (_number(t, "--range") for t in items)
    if lo <= 0:
        raise UsageError(f"--range: LO must be > 0, got {items[0]}")
    if lo >= hi:
        raise UsageError(f"--range: LO ({items[0]}) must be < HI ({items[1]})")
    return lo, hi


def scale_of(config: str) -> str | None:
    name = Path(config).stem if config.endswith((".yaml", ".yml")) else config
    name = SCALE_ALIASES.get(name, name)
    return name if name in SCALE_DEFAULTS else None


# ====================================================================================== selection
def select_best(points: list[dict]) -> dict:
    """Best finished point and whether it is interior to the grid (sorted by LR).

    Diverged points count as worse than any finite CE (so a diverged top point brackets the
    optimum from above); points without a result do not count. Returns ``{best_index, best_lr,
    best_val_ce, interior, edge ('lower'|'upper'|None), proposed_grid, ratio, complete}``.
    """
    lrs = [p["lr"] for p in points]
    if lrs != sorted(lrs):
        raise ValueError("points must be sorted by lr")
    scored = [(i, p["val_ce"]) for i, p in enumerate(points)
              if p.get("status") == "done" and p.get("val_ce") is not None and math.isfinite(p["val_ce"])]
    complete = all(p.get("status") in ("done", "diverged") for p in points)
    out: dict[str, Any] = {"best_index": None, "best_lr": None, "best_val_ce": None, "interior": None,
                           "edge": None, "proposed_grid": None, "ratio": None, "complete": complete}
    if not scored:
        return out
    i, ce = min(scored, key=lambda t: (t[1], t[0]))
    out.update(best_index=i, best_lr=lrs[i], best_val_ce=ce)
    n = len(lrs)
    if 0 < i < n - 1:
        out["interior"] = True
        return out
    out["interior"] = False
    if n < 2:
        return out
    if i == 0:
        ratio = lrs[1] / lrs[0]
        new = _round_sig(lrs[0] / ratio)
        out["edge"] = "lower"
    else:
        ratio = lrs[-1] / lrs[-2]
        new = _round_sig(lrs[-1] * ratio)
        out["edge"] = "upper"
    out["ratio"] = ratio
    out["proposed_grid"] = sorted(set(lrs) | {new})
    return out


# ====================================================================================== run state
def read_metrics(path: Path) -> list[dict]:
    """Records of a metrics.jsonl; a torn last line (a live or killed run) is ignored."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            rows.append(rec)
    return rows


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def point_state(run_dir: Path, end_step: int) -> dict:
    """Status of one screen run from its directory.

    done: the final step is logged with a finite ``val_ce``; diverged: the final ``val_ce`` is
    not finite, or the run aborted on a non-finite loss; interrupted: exit 75 (checkpointed) or
    killed by a signal; failed: another exit without the final evaluation; partial: started, not finished, no exit recorded (running, or
    killed); pending: never started.
    """
    st: dict[str, Any] = {"status": "pending", "val_ce": None, "val_ppl": None, "val_depth": None,
                          "steps": 0, "final_loss": None, "exit_code": None}
    if not run_dir.exists():
        return st
    rows = read_metrics(run_dir / "metrics.jsonl")
    exit_file = run_dir / "screen_exit"
    if exit_file.is_file():
        try:
            st["exit_code"] = int(exit_file.read_text().strip())
        except ValueError:
            pass
    if rows:
        st["steps"] = rows[-1]["step"]
        st["final_loss"] = rows[-1].get("loss")
    final = next((r for r in reversed(rows) if r["step"] == end_step and "val_ce" in r), None)
    if final is not None:
        st.update(val_ce=final["val_ce"], val_ppl=final.get("val_ppl"), val_depth=final.get("val_depth"))
        st["status"] = "done" if _finite(final["val_ce"]) else "diverged"
        return st
    code = st["exit_code"]
    if code is None:
        st["status"] = "partial" if (rows or (run_dir / "checkpoints").exists()) else "pending"
        return st
    if code == 0:
        st["status"] = "failed"  # exited cleanly without logging the final evaluation
    elif code == EXIT_REQUEUE or code < 0 or code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        st["status"] = "interrupted"  # checkpointed on a signal, or killed by one before training
    else:
        train_log = run_dir / "train.log"
        tail = train_log.read_text(errors="replace")[-20000:] if train_log.is_file() else ""
        nonfinite = "NonFiniteLossError" in tail or (rows and not _finite(rows[-1].get("loss")))
        st["status"] = "diverged" if nonfinite else "failed"
    return st


TERMINAL = ("done", "diverged")


# ====================================================================================== settings
@dataclass
class Screen:
    config: str
    out: Path
    lrs: list[float]
    stop_after: int
    max_steps: int
    eval_depth: int
    eval_batches: int
    screen_set: str
    overrides: list[str]
    micro_batch_size: int
    warmup_steps: int
    screen_info: dict = field(default_factory=dict)

    @property
    def end_step(self) -> int:
        return min(self.stop_after, self.max_steps)

    def run_dir(self, lr: float) -> Path:
        return self.out / f"lr_{lr_tag(lr)}"

    def train_args(self, lr: float) -> list[str]:
        """Arguments after ``megaloop.cli train`` for one point (options first, then overrides)."""
        return ["--config", self.config, "--run-dir", str(self.run_dir(lr)), "--resume", "auto",
                *self.point_overrides(lr)]

    def point_overrides(self, lr: float) -> list[str]:
        """The screen's overrides, then the user's (which may override logging.* but not these)."""
        name = f"lrscreen-{Path(self.config).stem}-{self.out.name}-lr_{lr_tag(lr)}"
        return [f"optim.lr={lr_tag(lr)}", f"train.stop_after={self.stop_after}",
                f"data.val_path={self.screen_set}", f"train.eval_depth={self.eval_depth}",
                f"train.eval_batches={self.eval_batches}", "logging.progress=false",
                f"logging.name={name}", *self.overrides]

    def fixed(self) -> dict:
        return {"config": self.config, "stop_after": self.stop_after, "max_steps": self.max_steps,
                "eval_depth": self.eval_depth, "eval_batches": self.eval_batches,
                "screen_set": self.screen_set, "overrides": self.overrides}


def _load_config(config: str, overrides: list[str]):
    from megaloop.config import load_config
    from megaloop.config_utils import ConfigError

    try:
        return load_config(config, overrides)
    except ConfigError as err:
        raise UsageError(f"--config {config}: {err}") from None
    except FileNotFoundError as err:
        raise UsageError(f"--config: {err}") from None


def _screen_manifest(path: str) -> dict | None:
    """manifest.json of a local screen set (None for remote URLs / the embedded default)."""
    if "://" in path or path == "default" or path.startswith("default:"):
        return None
    p = Path(path)
    mf = p / "manifest.json"
    if not p.is_dir():
        raise UsageError(f"--screen-set: {path} is not a directory (expected an MDS dataset, e.g. the "
                         "screen/ directory written by data_prep/build_eval_sets.py)")
    if not mf.is_file():
        raise UsageError(f"--screen-set: {path} has no manifest.json (not a megaloop MDS dataset)")
    try:
        return json.loads(mf.read_text())
    except ValueError as err:
        raise UsageError(f"--screen-set: {mf} is not valid JSON ({err})") from None


def build_screen(args: argparse.Namespace, extras: list[str]) -> Screen:
    for ov in extras:
        if "=" not in ov:
            raise UsageError(f"override {ov!r}: expected key=value (dotlist) after --")
        key = ov.split("=", 1)[0].strip()
        if key in RESERVED:
            flag = {"optim.lr": "--grid/--range", "train.stop_after": "--stop-after",
                    "data.val_path": "--screen-set", "train.eval_depth": "--eval-depth",
                    "train.eval_batches": "--eval-batches"}[key]
            raise UsageError(f"override {ov!r}: {key} is set by the screen; use {flag}")
    scale = scale_of(args.config)
    defaults = SCALE_DEFAULTS.get(scale or "", {})
    if args.points is not None and args.points < 3:
        raise UsageError(f"--points: needs at least 3 points to bracket an optimum, got {args.points}")
    if args.grid is not None:
        if args.range is not None:
            raise UsageError("--grid: give either --grid or --range, not both")
        if args.points is not None:
            raise UsageError("--points: only applies to --range (the grid fixes the points)")
        lrs = parse_grid(args.grid)
    else:
        if args.range is not None:
            lo, hi = parse_range(args.range)
        elif defaults:
            lo, hi = defaults["range"]
        else:
            raise UsageError(f"--grid/--range: no default LR range for config {args.config!r} "
                             f"(defaults exist for {', '.join(SCALE_DEFAULTS)}); give one")
        points = args.points if args.points is not None else defaults.get("points", 5)
        lrs = log_grid(lo, hi, points)
        if len({lr_tag(x) for x in lrs}) != len(lrs):
            raise UsageError(f"--points: {points} points in [{lo}, {hi}] collide after rounding to "
                             "3 significant digits; use fewer points or a wider range")
    stop_after = args.stop_after if args.stop_after is not None else defaults.get("stop_after")
    if stop_after is None:
        raise UsageError(f"--stop-after: no default for config {args.config!r}; give the number of updates")
    if stop_after < 1:
        raise UsageError(f"--stop-after: must be >= 1, got {stop_after}")
    if args.eval_depth < 1:
        raise UsageError(f"--eval-depth: must be >= 1, got {args.eval_depth}")
    if args.eval_batches is not None and args.eval_batches < 1:
        raise UsageError(f"--eval-batches: must be >= 1, got {args.eval_batches}")
    if args.parallel is not None and args.parallel < 1:
        raise UsageError(f"--parallel: must be >= 1, got {args.parallel}")
    if args.nproc < 1:
        raise UsageError(f"--nproc: must be >= 1, got {args.nproc}")

    base = _load_config(args.config, extras)
    if stop_after > base.train.max_steps:
        raise UsageError(f"--stop-after: {stop_after} exceeds the schedule horizon train.max_steps="
                         f"{base.train.max_steps}; a screen stops inside the full run's schedule")
    for lr in lrs:  # e.g. optim.min_lr > lr fails here, before anything runs
        _load_config(args.config, [*extras, f"optim.lr={lr_tag(lr)}", f"train.stop_after={stop_after}",
                                   f"train.eval_depth={args.eval_depth}"])

    screen_set = args.screen_set
    if screen_set is None:
        if base.data.path == "default" or base.data.path == "default:train":
            screen_set = "default:screen"  # the embedded corpus's frozen screen split
        else:
            raise UsageError(
                f"--screen-set: required for data.path={base.data.path} (only the embedded default "
                "dataset has a known screen set); pass the screen/ directory written by "
                "data_prep/build_eval_sets.py (304 x 1,536 tokens by default)")
    if base.data.val_path and screen_set == base.data.val_path:
        raise UsageError(f"--screen-set: {screen_set} is the main validation set (data.val_path); "
                         "SPEC §11 screens on a distinct frozen set")
    manifest = _screen_manifest(screen_set)
    info: dict[str, Any] = {"path": screen_set}
    eval_batches = args.eval_batches
    if manifest is not None:
        seq = manifest.get("seq_len")
        info.update({k: manifest.get(k) for k in ("kind", "seq_len", "num_sequences", "fingerprint")})
        if seq is not None and seq > base.model.seq_len:
            raise UsageError(
                f"--screen-set: {screen_set} holds {seq}-token sequences, longer than model.seq_len "
                f"{base.model.seq_len}; build the set with data_prep/build_eval_sets.py "
                f"--screen-seq-len {base.model.seq_len} (or shorter: evaluation runs at the set's length)")
        if manifest.get("kind") not in (None, "screen"):
            log(f"warning: {screen_set} is a {manifest.get('kind')!r} set, not an LR-screen set")
        if eval_batches is None and manifest.get("num_sequences"):
            eval_batches = -(-int(manifest["num_sequences"]) // base.train.micro_batch_size)
    if eval_batches is None:
        eval_batches = WHOLE_SET  # the trainer stops at the end of the set
    return Screen(config=args.config, out=Path(args.out).resolve(), lrs=lrs, stop_after=stop_after,
                  max_steps=base.train.max_steps, eval_depth=args.eval_depth, eval_batches=eval_batches,
                  screen_set=screen_set, overrides=list(extras),
                  micro_batch_size=base.train.micro_batch_size,
                  warmup_steps=base.optim.warmup_steps, screen_info=info)


def check_fixed_settings(screen: Screen) -> None:
    """OUT may be reused with a changed grid, but not with other settings (results would mix)."""
    path = screen.out / "screen.json"
    if not path.is_file():
        return
    try:
        old = json.loads(path.read_text())
    except ValueError:
        return
    diff = [f"{k}: {old.get(k)!r} -> {screen.fixed()[k]!r}" for k in FIXED_SETTINGS
            if k in old and old.get(k) != screen.fixed()[k]]
    if diff:
        raise UsageError(f"--out: {screen.out} holds a screen with other settings ({'; '.join(diff)}); "
                         "use a new --out directory or the same settings")


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, allow_nan=True) + "\n")
    os.replace(tmp, path)


# ====================================================================================== launchers
def _record_launch(screen: Screen, lr: float, launcher: str, cmd: list[str], **extra: Any) -> None:
    with open(screen.out / "launches.jsonl", "a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "lr": lr, "launcher": launcher,
                            "cmd": cmd, **extra}) + "\n")


def local_command(screen: Screen, lr: float, nproc: int) -> list[str]:
    if nproc > 1:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}", "-m", "megaloop.cli", "train"]
    else:
        head = [sys.executable, "-m", "megaloop.cli", "train"]
    return [*head, *screen.train_args(lr)]


class _Stop(Exception):
    pass


def run_local(screen: Screen, todo: list[float], parallel: int, nproc: int,
              devices: list[str] | None) -> None:
    """Run the points as subprocesses, ``parallel`` at a time; Ctrl-C / SIGTERM checkpoint them."""
    if devices is not None and len(devices) < parallel * nproc:
        raise UsageError(f"--devices: {len(devices)} device(s) for --parallel {parallel} x --nproc {nproc}")
    queue = list(todo)
    running: dict[int, tuple[subprocess.Popen, float, float, Any]] = {}  # slot -> (proc, lr, t0, log)
    free = list(range(parallel))

    def on_term(signum, _frame):  # noqa: ANN001
        raise _Stop(signal.Signals(signum).name)

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        try:
            while queue or running:
                while queue and free:
                    slot, lr = free.pop(0), queue.pop(0)
                    run_dir = screen.run_dir(lr)
                    run_dir.mkdir(parents=True, exist_ok=True)
                    (run_dir / "screen_exit").unlink(missing_ok=True)
                    cmd = local_command(screen, lr, nproc)
                    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
                    if devices is not None:
                        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[slot * nproc:(slot + 1) * nproc])
                    logf = open(run_dir / "train.log", "a")
                    logf.write(f"=== lr_screen {time.strftime('%Y-%m-%dT%H:%M:%S')}: {shlex.join(cmd)}\n")
                    logf.flush()
                    resumed = (run_dir / "checkpoints").exists()
                    log(f"launch lr={lr_tag(lr)}{' (resuming)' if resumed else ''} -> {run_dir}/train.log")
                    _record_launch(screen, lr, "local", cmd, resumed=resumed)
                    # own session: a terminal's Ctrl-C reaches only this tool, which then asks the
                    # runs to checkpoint (SIGTERM) instead of killing them mid-step.
                    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                            start_new_session=True)
                    running[slot] = (proc, lr, time.time(), logf)
                time.sleep(0.2)
                for slot in list(running):
                    proc, lr, t0, logf = running[slot]
                    code = proc.poll()
                    if code is None:
                        continue
                    logf.close()
                    _finish(screen, lr, code, time.time() - t0)
                    del running[slot]
                    free.append(slot)
                    free.sort()
        except (KeyboardInterrupt, _Stop) as why:
            log(f"interrupted ({why or 'SIGINT'}): asking {len(running)} run(s) to checkpoint and stop")
            for proc, *_ in running.values():
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            for slot, (proc, lr, t0, logf) in running.items():
                try:
                    code = proc.wait(timeout=600)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    code = proc.wait()
                logf.close()
                _finish(screen, lr, code, time.time() - t0)
            raise KeyboardInterrupt from None
    finally:
        signal.signal(signal.SIGTERM, old)


def _finish(screen: Screen, lr: float, code: int, seconds: float) -> None:
    run_dir = screen.run_dir(lr)
    (run_dir / "screen_exit").write_text(f"{code}\n")
    st = point_state(run_dir, screen.end_step)
    ce = f" val_ce={st['val_ce']:.4f}" if _finite(st["val_ce"]) else ""
    log(f"lr={lr_tag(lr)} {st['status']} (exit {code}, step {st['steps']}/{screen.end_step}, "
        f"{seconds:.0f}s){ce}")
    if st["status"] == "failed":
        tail = (run_dir / "train.log").read_text(errors="replace").splitlines()[-8:]
        for line in tail:
            print(f"    | {line}", flush=True)


def compress_indices(idx: list[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2,5,7-8' (sbatch --array syntax)."""
    parts, i = [], 0
    idx = sorted(idx)
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        parts.append(str(idx[i]) if i == j else f"{idx[i]}-{idx[j]}")
        i = j + 1
    return ",".join(parts)


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise UsageError(f"--launcher slurm: {tool!r} not found on PATH (run on a slurm login node)")
    return path


def active_array_tasks(job_id: str) -> set[int] | None:
    """Array task ids of ``job_id`` still queued or running; None when squeue does not know it."""
    proc = subprocess.run([_need("squeue"), "-h", "-r", "-j", job_id, "-o", "%i"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    out: set[int] = set()
    for line in proc.stdout.split():
        tail = line.rsplit("_", 1)[-1] if "_" in line else ""
        if tail.isdigit():
            out.add(int(tail))
    return out


def slurm_jobs(screen: Screen) -> list[dict]:
    path = screen.out / "slurm" / "jobs.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def slurm_active(screen: Screen) -> dict[float, str]:
    """LR -> job id of points whose array task is still in squeue."""
    active: dict[float, str] = {}
    for job in slurm_jobs(screen):
        tasks = active_array_tasks(str(job["job_id"]))
        for i in tasks or ():
            lr = job["lrs"].get(str(i))
            if lr is not None:
                active[float(lr)] = str(job["job_id"])
    return active


def write_point_args(points_dir: Path, screen: Screen, lr: float, index: int) -> Path:
    """POINTS_DIR/point_<i>.args: config, run dir, then one override per line (read by mapfile)."""
    lines = [screen.config, str(screen.run_dir(lr)), *screen.point_overrides(lr)]
    for x in lines:
        if "\n" in x:
            raise UsageError(f"override {x!r}: newlines are not supported in slurm screens")
    path = points_dir / f"point_{index}.args"
    path.write_text("\n".join(lines) + "\n")
    return path


def sbatch_command(screen: Screen, indices: list[int], parallel: int | None, sbatch_args: list[str]) -> list[str]:
    array = compress_indices(indices) + (f"%{parallel}" if parallel else "")
    return ["sbatch", "--parsable", f"--array={array}",
            f"--job-name=lrscreen-{Path(screen.config).stem}", f"--chdir={ROOT}", "--export=ALL",
            f"--output={screen.out / 'slurm' / '%A_%a.out'}", *sbatch_args,
            str(ROOT / "slurm" / "lr_screen_array.sh")]


def run_slurm(screen: Screen, todo: list[float], parallel: int | None, sbatch_args: list[str],
              dry_run: bool) -> str | None:
    """Submit the unfinished points as one array job; array index = the point's index in the grid.

    Each submission gets its own ``OUT/slurm/sub<k>/point_<i>.args`` (exported to the job as
    ``SCREEN_POINTS_DIR``), so a grid extended later (indices shift) never changes what an
    already-queued task reads.
    """
    index = {lr: i for i, lr in enumerate(screen.lrs)}
    indices = [index[lr] for lr in todo]
    cmd = sbatch_command(screen, indices, parallel, sbatch_args)
    if dry_run:
        log(f"would run: SCREEN_DIR={screen.out} {shlex.join(cmd)}")
        for lr in todo:
            log(f"  point {index[lr]}: lr={lr_tag(lr)}: megaloop train {shlex.join(screen.train_args(lr))}")
        return None
    points_dir = screen.out / "slurm" / f"sub{len(slurm_jobs(screen)):03d}"
    points_dir.mkdir(parents=True, exist_ok=True)
    for lr in todo:
        write_point_args(points_dir, screen, lr, index[lr])
    cmd[0] = _need("sbatch")
    env = {**os.environ, "SCREEN_DIR": str(screen.out), "SCREEN_POINTS_DIR": str(points_dir),
           "MEGALOOP_ROOT": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    job_id = proc.stdout.strip().split(";")[0].strip()
    if not job_id:
        raise RuntimeError(f"sbatch printed no job id: {proc.stdout!r}")
    with open(screen.out / "slurm" / "jobs.jsonl", "a") as f:
        f.write(json.dumps({"job_id": job_id, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                            "points_dir": str(points_dir), "lrs": {str(index[lr]): lr for lr in todo},
                            "cmd": cmd}) + "\n")
    for lr in todo:
        _record_launch(screen, lr, "slurm", cmd, job_id=job_id, array_index=index[lr])
    log(f"submitted array job {job_id} ({len(todo)} point(s): --array={compress_indices(indices)}); "
        f"logs in {screen.out / 'slurm'}")
    return job_id


def wait_slurm(job_id: str, poll: float) -> None:
    log(f"waiting for job {job_id} (squeue every {poll:g}s)")
    last = None
    while True:
        tasks = active_array_tasks(job_id)
        if not tasks:
            log(f"job {job_id}: no task left in the queue")
            return
        if tasks != last:
            log(f"job {job_id}: {len(tasks)} task(s) queued or running: {compress_indices(sorted(tasks))}")
            last = tasks
        time.sleep(poll)


# ====================================================================================== report
def collect(screen: Screen, active: dict[float, str] | None = None) -> list[dict]:
    points = []
    for i, lr in enumerate(screen.lrs):
        st = point_state(screen.run_dir(lr), screen.end_step)
        if active and lr in active and st["status"] not in TERMINAL:
            st["status"] = "queued"
        points.append({"index": i, "lr": lr, **st, "target_steps": screen.end_step,
                       "run_dir": str(screen.run_dir(lr))})
    return points


def _fmt(x: Any, spec: str = ".4f") -> str:
    return format(x, spec) if _finite(x) else ("" if x is None else str(x))


def write_results(screen: Screen, points: list[dict], sel: dict, argv_cmd: str | None) -> dict:
    out = screen.out
    cols = ["index", "lr", "status", "val_ce", "val_ppl", "val_depth", "steps", "target_steps",
            "final_loss", "exit_code", "best", "run_dir"]
    tmp = out / ".results.csv.tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for p in points:
            w.writerow({**{k: p.get(k) for k in cols}, "lr": lr_tag(p["lr"]),
                        "val_ce": _fmt(p["val_ce"], ".6f"), "val_ppl": _fmt(p["val_ppl"], ".4f"),
                        "final_loss": _fmt(p["final_loss"], ".6f"),
                        "best": int(p["index"] == sel["best_index"])})
    os.replace(tmp, out / "results.csv")
    result = {
        "config": screen.config, "grid": screen.lrs, "stop_after": screen.stop_after,
        "max_steps": screen.max_steps, "eval_depth": screen.eval_depth,
        "eval_batches": None if screen.eval_batches == WHOLE_SET else screen.eval_batches,
        "screen_set": screen.screen_info, "overrides": screen.overrides, "points": points,
        "best": None if sel["best_index"] is None else
        {"index": sel["best_index"], "lr": sel["best_lr"], "val_ce": sel["best_val_ce"],
         "run_dir": points[sel["best_index"]]["run_dir"]},
        "interior": sel["interior"], "edge": sel["edge"], "complete": sel["complete"],
        "proposed_grid": sel["proposed_grid"], "proposed_command": argv_cmd,
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    write_json(out / "results.json", result)
    return result


def plot(screen: Screen, points: list[dict], sel: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        log("matplotlib is not installed: no screen.png")
        return None
    done = [p for p in points if p["status"] == "done"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    if done:
        ax.plot([p["lr"] for p in done], [p["val_ce"] for p in done], "o-", color="tab:blue",
                label="finished")
    ces = [p["val_ce"] for p in done]
    top = (max(ces) + 0.05 * (max(ces) - min(ces) + 1e-3)) if ces else 1.0
    bad = [p for p in points if p["status"] == "diverged"]
    if bad:
        ax.plot([p["lr"] for p in bad], [top] * len(bad), "x", color="tab:red", ms=9, mew=2,
                label="diverged")
    if sel["best_index"] is not None:
        b = points[sel["best_index"]]
        ax.plot([b["lr"]], [b["val_ce"]], "*", color="gold" if sel["interior"] else "tab:red", ms=18,
                mec="black", zorder=5, label=f"best {lr_tag(b['lr'])}: {b['val_ce']:.4f}")
    for lr in screen.lrs:
        ax.axvline(lr, color="0.9", lw=0.8, zorder=0)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel(f"validation CE at R={screen.eval_depth} (screen set)")
    title = f"LR screen: {Path(screen.config).stem}, {screen.end_step} of {screen.max_steps} updates"
    if sel["edge"]:
        title += f"\nBEST ON THE {sel['edge'].upper()} EDGE: extend the grid"
    ax.set_title(title, fontsize=10, color="tab:red" if sel["edge"] else "black")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def proposal_command(args: argparse.Namespace, screen: Screen, grid: list[float]) -> str:
    cmd = ["python", "tools/lr_screen.py", "--config", screen.config,
           "--grid", ",".join(lr_tag(x) for x in grid), "--launcher", args.launcher,
           "--out", str(screen.out), "--stop-after", str(screen.stop_after),
           "--eval-depth", str(screen.eval_depth)]
    if args.screen_set is not None:
        cmd += ["--screen-set", args.screen_set]
    if args.eval_batches is not None:
        cmd += ["--eval-batches", str(args.eval_batches)]
    if screen.overrides:
        cmd += ["--", *screen.overrides]
    return shlex.join(cmd)


def report(screen: Screen, points: list[dict], sel: dict, proposal: str | None) -> None:
    print(f"\nLR screen {screen.config}: stop after {screen.end_step} of {screen.max_steps} updates, "
          f"val CE at R={screen.eval_depth} on {screen.screen_set}")
    print(f"  {'lr':>10}  {'status':<11} {'steps':>11}  {'val_ce':>9}  {'val_ppl':>10}")
    for p in points:
        mark = "  <- best" if p["index"] == sel["best_index"] else ""
        print(f"  {lr_tag(p['lr']):>10}  {p['status']:<11} {p['steps']:>5}/{p['target_steps']:<5}  "
              f"{_fmt(p['val_ce']):>9}  {_fmt(p['val_ppl'], '.2f'):>10}{mark}")
    if sel["best_index"] is None:
        print("  no finished point yet")
    elif sel["interior"]:
        print(f"  best lr {lr_tag(sel['best_lr'])} (val_ce {sel['best_val_ce']:.4f}) is interior to the grid")
    else:
        bar = "!" * 78
        r = sel["ratio"]
        print(f"\n{bar}\n!! WARNING: best lr {lr_tag(sel['best_lr'])} is on the {sel['edge'].upper()} EDGE "
              f"of the grid: the optimum is NOT bracketed.\n"
              f"!! Extend the grid by one log step (x{r:.3g}) beyond that edge; finished points are reused:\n"
              f"!!   proposed grid: {','.join(lr_tag(x) for x in sel['proposed_grid'])}\n"
              f"!!   {proposal}\n{bar}")
    if not sel["complete"]:
        n = sum(p["status"] not in TERMINAL for p in points)
        print(f"  {n} point(s) not finished: the selection is provisional")


# ====================================================================================== main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lr_screen.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Learning-rate screen (SPEC §11): short runs over a log-spaced LR grid, selected "
                    "by validation CE at R=5 on the frozen screen set.",
        epilog="Per-scale defaults (used when --grid/--range/--stop-after are not given):\n" + "\n".join(
            f"  {k:<5} range [{v['range'][0]:g}, {v['range'][1]:g}], {v['points']} points, "
            f"stop after {v['stop_after']}" for k, v in SCALE_DEFAULTS.items())
        + "\n  (untied4/untied12 use S's)\nExtra dotlist overrides for every run go after --.")
    p.add_argument("--config", required=True, help="preset (tiny, S, M, L, untied4, untied12) or YAML path")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--grid", help="comma-separated learning rates, e.g. 5e-4,1e-3,2e-3")
    g.add_argument("--range", help="LO,HI: log-spaced grid of --points values from LO to HI")
    p.add_argument("--points", type=int, help="number of grid points for --range (>= 3)")
    p.add_argument("--out", required=True, help="screen directory (run dirs, results.csv/json, screen.png)")
    p.add_argument("--launcher", choices=("local", "slurm"), default="local")
    p.add_argument("--stop-after", type=int, help="updates per screen run (absolute step count)")
    p.add_argument("--screen-set", help="MDS LR-screen set (default: the embedded corpus's "
                   "'default:screen' when data.path is the embedded default; required otherwise)")
    p.add_argument("--eval-depth", type=int, default=5, help="recurrence depth of the selection CE (5)")
    p.add_argument("--eval-batches", type=int, help="eval micro-batches (default: the whole screen set)")
    p.add_argument("--parallel", type=int, help="local: runs at a time (default 1); slurm: array "
                   "throttle %%K (default none)")
    p.add_argument("--nproc", type=int, default=1, help="local: processes per run (torchrun --standalone)")
    p.add_argument("--devices", help="local: comma-separated CUDA devices split among parallel runs")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="slurm: extra sbatch argument, repeatable (e.g. --sbatch-arg=--partition=gpu)")
    p.add_argument("--wait", action="store_true", help="slurm: poll squeue until the array finishes, then report")
    p.add_argument("--poll", type=float, default=60.0, help="slurm --wait: seconds between squeue polls")
    p.add_argument("--collect", action="store_true", help="launch nothing: collect, plot and report")
    p.add_argument("--dry-run", action="store_true", help="print what would run; write nothing")
    p.add_argument("--fail-on-edge", action="store_true", help="exit 3 when the best LR is on a grid edge")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extras: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extras = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        screen = build_screen(args, extras)
        if not args.dry_run:
            check_fixed_settings(screen)
    except UsageError as err:
        print(f"lr_screen.py: error: {err}", file=sys.stderr)
        return 2

    log(f"config {screen.config}: {len(screen.lrs)} points {[lr_tag(x) for x in screen.lrs]}, "
        f"stop after {screen.end_step} of {screen.max_steps} updates, val CE at R={screen.eval_depth} on "
        f"{screen.screen_set} ({'whole set' if screen.eval_batches == WHOLE_SET else f'{screen.eval_batches} micro-batches'})")
    if screen.end_step <= screen.warmup_steps:
        log(f"warning: the screen stops at step {screen.end_step}, inside the LR warm-up "
            f"(optim.warmup_steps={screen.warmup_steps}): no run reaches its peak LR")

    if not args.dry_run:
        screen.out.mkdir(parents=True, exist_ok=True)
        write_json(screen.out / "screen.json", {**screen.fixed(), "grid": screen.lrs,
                                                "screen_set_info": screen.screen_info})
    try:
        active = slurm_active(screen) if (args.launcher == "slurm" and not args.dry_run
                                          and slurm_jobs(screen)) else {}
    except UsageError as err:
        print(f"lr_screen.py: error: {err}", file=sys.stderr)
        return 2
    todo = []
    for lr in screen.lrs:
        st = point_state(screen.run_dir(lr), screen.end_step)
        if st["status"] in TERMINAL:
            ce = f", val_ce={st['val_ce']:.4f}" if _finite(st["val_ce"]) else ""
            log(f"skip lr={lr_tag(lr)}: {st['status']} (step {st['steps']}{ce})")
        elif lr in active:
            log(f"skip lr={lr_tag(lr)}: still queued/running in slurm job {active[lr]}")
        else:
            todo.append(lr)

    code = 0
    if args.collect:
        pass
    elif args.dry_run:
        if args.launcher == "local":
            for lr in todo:
                log(f"would run: {shlex.join(local_command(screen, lr, args.nproc))}")
        else:
            try:
                run_slurm(screen, todo, args.parallel, args.sbatch_arg, dry_run=True)
            except UsageError as err:
                print(f"lr_screen.py: error: {err}", file=sys.stderr)
                return 2
        return 0
    elif args.launcher == "local":
        devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else None
        try:
            if todo:
                run_local(screen, todo, args.parallel or 1, args.nproc, devices)
        except UsageError as err:
            print(f"lr_screen.py: error: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            code = 130
    else:
        try:
            job = run_slurm(screen, todo, args.parallel, args.sbatch_arg, dry_run=False) if todo else None
            if args.wait:
                for j in ([job] if job else []) + sorted(set(active.values())):
                    wait_slurm(j, args.poll)
                active = {}
            elif job or active:
                active = {**slurm_active(screen), **{lr: job for lr in todo if job}}
                log("not waiting (--wait not given): rerun this command, or add --collect, to collect "
                    "results when the jobs are done")
        except UsageError as err:
            print(f"lr_screen.py: error: {err}", file=sys.stderr)
            return 2
        except RuntimeError as err:
            print(f"lr_screen.py: error: {err}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            log("stopped waiting; the slurm jobs keep running (rerun to collect)")
            code = 130

    points = collect(screen, active)
    sel = select_best(points)
    proposal = proposal_command(args, screen, sel["proposed_grid"]) if sel["proposed_grid"] else None
    write_results(screen, points, sel, proposal)
    png = plot(screen, points, sel, screen.out / "screen.png")
    report(screen, points, sel, proposal)
    print(f"  results: {screen.out / 'results.csv'}, {screen.out / 'results.json'}"
          + (f", {png}" if png else ""))
    if code:
        return code
    if any(p["status"] in ("failed", "interrupted", "partial", "pending") for p in points):
        return 1  # "queued" (still in slurm) is not a failure
    if sel["edge"] and args.fail_on_edge:
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
