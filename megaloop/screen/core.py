"""LR screens (SPEC §11): grid, selection, per-point run state and the screen's settings.

The command line is ``megaloop lr-screen`` (megaloop/screen/cli.py, whose docstring describes the
whole tool); a screen is a plan of runs on megaloop/sweep.py."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megaloop.config_utils import dotlist_settings
from megaloop.errors import UserError
from megaloop.sweep import Run, Sweep, read_exit, stopped, trained_model_differences
from megaloop.train.metrics import read_metrics

TAG = "lr_screen"  # log prefix
EXIT_FILE = "screen_exit"  # RUN_DIR/screen_exit: the last training exit status
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


def log(msg: str) -> None:
    print(f"[{TAG}] {msg}", flush=True)


# ====================================================================================== grid
def lr_tag(lr: float) -> str:
    """Canonical text of a learning rate: used in run-dir names and in ``optim.lr=``."""
    return f"{lr:.6g}"


def run_name(lr: float) -> str:
    """A grid point's run (and run-directory) name: ``lr_<lr_tag>``."""
    return f"lr_{lr_tag(lr)}"


def _round_sig(x: float, digits: int = 3) -> float:
    return float(f"{x:.{digits}g}")


def log_grid(lo: float, hi: float, points: int) -> list[float]:
    """``points`` log-spaced values from ``lo`` to ``hi`` (inclusive), 3 significant digits."""
    return [_round_sig(lo * (hi / lo) ** (i / (points - 1))) for i in range(points)]


def _number(text: str, arg: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"{arg}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise UserError(f"{arg}: {text!r} is not a finite number")
    return value


def parse_grid(text: str) -> list[float]:
    items = [t.strip() for t in text.split(",")]
    if not any(items):
        raise UserError("--grid: empty grid; give comma-separated learning rates, e.g. --grid 1e-3,2e-3,4e-3")
    if "" in items:
        raise UserError(f"--grid: empty entry in {text!r}")
    lrs = [_number(t, "--grid") for t in items]
    bad = [t for t, v in zip(items, lrs) if v <= 0]
    if bad:
        raise UserError(f"--grid: learning rates must be > 0, got {', '.join(bad)}")
    tags = [lr_tag(v) for v in lrs]
    dups = sorted({t for t in tags if tags.count(t) > 1})
    if dups:
        raise UserError(f"--grid: duplicate learning rate(s) {', '.join(dups)}")
    if len(lrs) < 3:
        raise UserError(f"--grid: needs at least 3 learning rates to bracket an optimum, got {len(lrs)}")
    return sorted(lrs)


def parse_range(text: str) -> tuple[float, float]:
    items = [t.strip() for t in text.split(",")]
    if len(items) != 2 or not all(items):
        raise UserError(f"--range: expected LO,HI (two numbers), got {text!r}")
    lo, hi = (_number(t, "--range") for t in items)
    if lo <= 0:
        raise UserError(f"--range: LO must be > 0, got {items[0]}")
    if lo >= hi:
        raise UserError(f"--range: LO ({items[0]}) must be < HI ({items[1]})")
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
    best_val_ce, interior, edge ('lower'|'upper'|None), proposed_grid, ratio, complete, missing,
    all_diverged}``. While points are missing (``missing``: their LRs) the best is provisional: no
    interior / edge verdict (interior None) and no proposed grid, since a missing point may move the
    optimum. A complete screen whose every point diverged has no best point and its optimum lies
    below the grid: edge ``lower``, one log step below the lowest LR proposed (×10 for a one-point grid).
    """
    lrs = [p["lr"] for p in points]
    if lrs != sorted(lrs):
        raise ValueError("points must be sorted by lr")
    scored = [(i, p["val_ce"]) for i, p in enumerate(points)
              if p.get("status") == "done" and p.get("val_ce") is not None and math.isfinite(p["val_ce"])]
    missing = [p["lr"] for p in points if p.get("status") not in ("done", "diverged")]
    complete = not missing
    out: dict[str, Any] = {"best_index": None, "best_lr": None, "best_val_ce": None, "interior": None,
                           "edge": None, "proposed_grid": None, "ratio": None, "complete": complete,
                           "missing": missing, "all_diverged": False}
    if not scored:
        if complete and points:  # every point diverged: nothing selectable, the optimum is lower
            ratio = lrs[1] / lrs[0] if len(lrs) > 1 else 10.0
            out.update(interior=False, edge="lower", ratio=ratio, all_diverged=True,
                       proposed_grid=sorted(set(lrs) | {_round_sig(lrs[0] / ratio)}))
        return out
    i, ce = min(scored, key=lambda t: (t[1], t[0]))
    out.update(best_index=i, best_lr=lrs[i], best_val_ce=ce, flat=False)
    if not complete:
        return out
    if len(scored) > 1 and all(c == ce for _, c in scored):
        # every finished point ties exactly: the budget cannot tell these LRs apart, so there is no optimum
        # to bracket (it was reported as the lowest LR on the lower edge, proposing lower LRs still)
        out.update(interior=False, flat=True)
        return out
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
def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def point_state(run_dir: Path, end_step: int) -> dict:
    """Status of one screen run from its directory.

    done: the final step is logged with a finite ``val_ce``; diverged: the final ``val_ce`` is
    not finite, or the run aborted on a non-finite loss; interrupted: stopped (``sweep.stopped``:
    checkpointed on a signal, or killed by one); failed: another exit without the final
    evaluation; partial: started, not finished, no exit recorded (running, or killed); pending:
    never started.
    """
    st: dict[str, Any] = {"status": "pending", "val_ce": None, "val_ppl": None, "val_depth": None,
                          "steps": 0, "final_loss": None, "exit_code": None}
    if not run_dir.exists():
        return st
    rows = read_metrics(run_dir / "metrics.jsonl")
    st["exit_code"] = read_exit(run_dir, EXIT_FILE)
    if rows:
        st["steps"] = rows[-1]["step"]
        st["final_loss"] = rows[-1].get("loss")
    final = next((r for r in reversed(rows) if r["step"] == end_step and "val_ce" in r), None)
    if final is not None:
        st.update(val_ce=final["val_ce"], val_ppl=final.get("val_ppl"), val_depth=final.get("val_depth"))
        st["status"] = "done" if finite(final["val_ce"]) else "diverged"
        return st
    code = st["exit_code"]
    if code is None:
        st["status"] = "partial" if (rows or (run_dir / "checkpoints").exists()) else "pending"
        return st
    if code == 0:
        st["status"] = "failed"  # exited cleanly without logging the final evaluation
    elif stopped(code):
        st["status"] = "interrupted"  # checkpointed on a signal, or killed by one before training
    else:
        train_log = run_dir / "train.log"
        tail = train_log.read_text(errors="replace")[-20000:] if train_log.is_file() else ""
        nonfinite = "NonFiniteLossError" in tail or (rows and not finite(rows[-1].get("loss")))
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
    global_batch_size: int = 0  # sequences per update (train.eval_batches counts these)
    data_path: str = ""  # the runs' training data (data.path), which --out must stay out of

    @property
    def end_step(self) -> int:
        return min(self.stop_after, self.max_steps)

    def run_dir(self, lr: float) -> Path:
        return self.out / run_name(lr)

    def sweep(self) -> Sweep:
        """The screen as a plan of runs: one per grid point, in grid order (the array index)."""
        runs = [Run(name=run_name(lr), run_dir=self.run_dir(lr), config=self.config,
                    overrides=self.point_overrides(lr)) for lr in self.lrs]
        return Sweep(out=self.out, runs=runs, tag=TAG, exit_file=EXIT_FILE)

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
        cfg = load_config(config, overrides)
        cfg.check_trainable()  # what each point's `megaloop train` refuses: named before anything runs
        return cfg
    except ConfigError as err:
        raise UserError(f"--config {config}: {err}") from None
    except FileNotFoundError as err:
        raise UserError(f"--config: {err}") from None


def _screen_manifest(path: str) -> dict | None:
    """manifest.json of a local screen set (None for remote URLs / the embedded default)."""
    if "://" in path or path == "default" or path.startswith("default:"):
        return None
    p = Path(path)
    mf = p / "manifest.json"
    if not p.is_dir():
        raise UserError(f"--screen-set: {path} is not a directory (expected an MDS dataset, e.g. the "
                         "screen/ directory written by data_prep/build_eval_sets.py)")
    if not mf.is_file():
        raise UserError(f"--screen-set: {path} has no manifest.json (not a megaloop MDS dataset)")
    try:
        return json.loads(mf.read_text())
    except ValueError as err:
        raise UserError(f"--screen-set: {mf} is not valid JSON ({err})") from None


def build_screen(args: argparse.Namespace, extras: list[str]) -> Screen:
    for ov in extras:
        if "=" not in ov:
            raise UserError(f"override {ov!r}: expected key=value (dotlist) after --")
        key = ov.split("=", 1)[0].strip()
        if key in RESERVED:
            flag = {"optim.lr": "--grid/--range", "train.stop_after": "--stop-after",
                    "data.val_path": "--screen-set", "train.eval_depth": "--eval-depth",
                    "train.eval_batches": "--eval-batches"}[key]
            raise UserError(f"override {ov!r}: {key} is set by the screen; use {flag}")
    base = _load_config(args.config, extras)  # an unknown preset or a bad override is named first
    scale = scale_of(args.config)
    defaults = SCALE_DEFAULTS.get(scale or "", {})
    if args.points is not None and args.points < 3:
        raise UserError(f"--points: needs at least 3 points to bracket an optimum, got {args.points}")
    if args.grid is not None:
        if args.range is not None:
            raise UserError("--grid: give either --grid or --range, not both")
        if args.points is not None:
            raise UserError("--points: only applies to --range (the grid fixes the points)")
        lrs = parse_grid(args.grid)
    else:
        if args.range is not None:
            lo, hi = parse_range(args.range)
        elif defaults:
            lo, hi = defaults["range"]
        else:
            raise UserError(f"--grid/--range: no default LR range for config {args.config!r} "
                             f"(defaults exist for {', '.join(SCALE_DEFAULTS)}); give one")
        points = args.points if args.points is not None else defaults.get("points", 5)
        lrs = log_grid(lo, hi, points)
        if len({lr_tag(x) for x in lrs}) != len(lrs):
            raise UserError(f"--points: {points} points in [{lo}, {hi}] collide after rounding to "
                             "3 significant digits; use fewer points or a wider range")
    stop_after = args.stop_after if args.stop_after is not None else defaults.get("stop_after")
    if stop_after is None:
        raise UserError(f"--stop-after: no default for config {args.config!r}; give the number of updates")
    if stop_after < 1:
        raise UserError(f"--stop-after: must be >= 1, got {stop_after}")
    if args.eval_depth < 1:
        raise UserError(f"--eval-depth: must be >= 1, got {args.eval_depth}")
    if args.eval_batches is not None and args.eval_batches < 1:
        raise UserError(f"--eval-batches: must be >= 1, got {args.eval_batches}")

    if stop_after > base.train.max_steps:
        raise UserError(f"--stop-after: {stop_after} exceeds the schedule horizon train.max_steps="
                         f"{base.train.max_steps}; a screen stops inside the full run's schedule")
    for lr in lrs:  # e.g. optim.min_lr > lr fails here, before anything runs
        _load_config(args.config, [*extras, f"optim.lr={lr_tag(lr)}", f"train.stop_after={stop_after}",
                                   f"train.eval_depth={args.eval_depth}"])

    screen_set = args.screen_set
    if screen_set is None:
        if base.data.path == "default" or base.data.path == "default:train":
            screen_set = "default:screen"  # the embedded corpus's frozen screen split
        else:
            raise UserError(
                f"--screen-set: required for data.path={base.data.path} (only the embedded default "
                "dataset has a known screen set); pass the screen/ directory written by "
                "data_prep/build_eval_sets.py (304 x 1,536 tokens by default)")
    if base.data.val_path and screen_set == base.data.val_path:
        raise UserError(f"--screen-set: {screen_set} is the main validation set (data.val_path); "
                         "SPEC §11 screens on a distinct frozen set")
    manifest = _screen_manifest(screen_set)
    info: dict[str, Any] = {"path": screen_set}
    eval_batches = args.eval_batches
    if manifest is not None:
        seq = manifest.get("seq_len")
        info.update({k: manifest.get(k) for k in ("kind", "seq_len", "num_sequences", "fingerprint")})
        if seq is not None and seq > base.model.seq_len:
            raise UserError(
                f"--screen-set: {screen_set} holds {seq}-token sequences, longer than model.seq_len "
                f"{base.model.seq_len}; build the set with data_prep/build_eval_sets.py "
                f"--screen-seq-len {base.model.seq_len} (or shorter: evaluation runs at the set's length)")
        if manifest.get("kind") not in (None, "screen"):
            log(f"warning: {screen_set} is a {manifest.get('kind')!r} set, not an LR-screen set")
        if eval_batches is None and manifest.get("num_sequences"):  # validation covers eval_batches x gbs
            eval_batches = -(-int(manifest["num_sequences"]) // base.train.global_batch_size)
    if eval_batches is None:
        eval_batches = WHOLE_SET  # the trainer stops at the end of the set
    return Screen(config=args.config, out=Path(args.out).resolve(), lrs=lrs, stop_after=stop_after,
                  max_steps=base.train.max_steps, eval_depth=args.eval_depth, eval_batches=eval_batches,
                  screen_set=screen_set, overrides=list(extras),
                  micro_batch_size=base.train.micro_batch_size,
                  warmup_steps=base.optim.warmup_steps, screen_info=info,
                  global_batch_size=base.train.global_batch_size, data_path=str(base.data.path or ""))


def _setting(screen: Screen, key: str, value: Any) -> Any:
    """A fixed setting as it acts: overrides as {key: last value}; eval_batches covering the
    whole screen set (its size known from the manifest) as "all"."""
    if key == "overrides" and isinstance(value, list):
        return dotlist_settings(value)
    if key == "eval_batches" and isinstance(value, int):
        n = screen.screen_info.get("num_sequences")
        if value == WHOLE_SET or (n and screen.global_batch_size and value * screen.global_batch_size >= n):
            return "all"
    return value


def check_fixed_settings(screen: Screen) -> None:
    """OUT may be reused with a changed grid, but not with other settings (results would mix).
    Overrides compare as the settings they make (the same ones in another order are the same), and
    two ``eval_batches`` that both cover the whole screen set are the same."""
    path = screen.out / "screen.json"
    if not path.is_file():
        return
    try:
        old = json.loads(path.read_text())
    except ValueError:
        return
    mine = screen.fixed()
    diff = [f"{k}: {old.get(k)!r} -> {mine[k]!r}" for k in FIXED_SETTINGS
            if k in old and _setting(screen, k, old.get(k)) != _setting(screen, k, mine[k])]
    if diff:
        raise UserError(f"--out: {screen.out} holds a screen with other settings ({'; '.join(diff)}); "
                         "use a new --out directory or the same settings")
    for lr in screen.lrs:  # same settings, but a point trained another model (a default changed since)
        if what := trained_model_differences(screen.run_dir(lr), screen.config, screen.point_overrides(lr)):
            raise UserError(f"--out: {screen.run_dir(lr)} trained another model than these settings give "
                            f"with today's defaults ({what}); use a new --out directory")

