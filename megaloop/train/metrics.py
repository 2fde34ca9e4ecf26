"""Metrics sinks: JSONL log (always), console with a rich progress bar, wandb (optional).

Only global rank 0 writes. ``RUN/metrics.jsonl`` gets one JSON object per optimizer step.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from megaloop.config import LoggingConfig
from megaloop.errors import UserError

CONSOLE_KEYS = ("loss", "lr", "grad_norm", "mean_depth", "prior_mean_depth", "tokens_per_s", "tflops", "mfu",
                "val_ce")
WANDB_ID_FILE = "wandb_id"  # RUN/wandb_id: the wandb run this run directory's log continues


class MetricsWriteError(UserError):
    """``RUN/metrics.jsonl`` could not be written (a full disk, a quota): one line, training stops."""


def wandb_run_id(run_dir: Path, name: str | None, *, new: bool) -> str:
    """The wandb run id of ``run_dir``: the one recorded in ``RUN/wandb_id`` (a resume continues it),
    or, when ``new`` (a fresh start, a resume from an older checkpoint) or without the file, a new one,
    ``<name or folder>-<8 hex>``, recorded.
    Two run directories never share an id (reproduce's seeds of one arm share ``logging.name``)."""
    import re
    import secrets

    from megaloop.runtime.files import atomic_write_text

    path = run_dir / WANDB_ID_FILE
    if not new and path.is_file() and (held := path.read_text().strip()):
        return held
    legacy = (name or run_dir.name).replace("/", "_")  # the id of a run started before RUN/wandb_id
    if not new and any((run_dir / "wandb").glob(f"*run-*-{legacy}")):
        atomic_write_text(path, legacy + "\n")
        return legacy
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", name or run_dir.resolve().name)[:96] or "run"
    run_id = f"{stem}-{secrets.token_hex(4)}"
    atomic_write_text(path, run_id + "\n")
    return run_id


def renew_wandb_id(run_dir: Path, name: str | None) -> None:
    """A new wandb run id for a run directory whose history is rewound, recorded at once (the trainer
    calls it before any checkpoint moves); a folder that never logged to wandb (no ``RUN/wandb_id``, no
    ``wandb/``) gets none here: the logger makes one, and a failed set-up leaves the folder empty."""
    if (run_dir / WANDB_ID_FILE).is_file() or (run_dir / "wandb").is_dir():
        wandb_run_id(run_dir, name, new=True)


class MetricsLogger:
    """Append-only JSONL + console + wandb sink for per-step metrics."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, *, enabled: bool, total_steps: int,
                 start_step: int, config_dict: dict, rewound: bool = False):
        """``rewound``: the run resumed from an older checkpoint than its newest (those set aside):
        its later steps are redone with other values, so wandb gets a new run (a run keeps only
        increasing steps). A resume from the newest checkpoint continues the recorded wandb run;
        steps logged after that checkpoint (a kill between saves) are redone identically and wandb
        online keeps its first copy of them."""
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self._wandb = None
        self._progress = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if start_step == 0 and self.path.exists():
            self.path.unlink()
        elif self.path.exists():
            self._truncate_after(start_step)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # a line: one unbuffered write
        if cfg.wandb == "disabled" and (start_step == 0 or rewound):  # a later wandb resume must not continue
            (run_dir / WANDB_ID_FILE).unlink(missing_ok=True)            # the run the redone steps left behind
        if cfg.wandb != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            run_id = wandb_run_id(run_dir, cfg.name, new=start_step == 0 or rewound)
            self._wandb = wandb.init(project=cfg.project, name=cfg.name or run_dir.resolve().name, mode=cfg.wandb,
                                     dir=str(run_dir), config=config_dict, resume="allow", id=run_id)
        # rich draws the bar on stdout: with stdout redirected (`> train.log`, `| tee`) and stderr still
        # a terminal, the terminal showed nothing and the file no step line, only the bar's last frame
        if cfg.progress and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
            self._progress.start()

    def _truncate_after(self, step: int) -> None:
        """On resume drop log lines of steps after the checkpoint (they will be redone) and a line a
        kill cut short. The file is rewritten whole or not at all (a kill during the rewrite lost the
        whole history), and only when a line goes."""
        from megaloop.runtime.files import atomic_write_file

        def kept(line: str) -> bool:
            try:
                return json.loads(line).get("step", 0) <= step
            except (json.JSONDecodeError, AttributeError):
                return False

        with open(self.path, encoding="utf-8", errors="replace") as f:
            if all(kept(line) and line.endswith("\n") for line in f):
                return

        def write(tmp: str) -> None:
            with open(self.path, encoding="utf-8", errors="replace") as src, open(tmp, "w", encoding="utf-8") as dst:
                dst.writelines(line if line.endswith("\n") else line + "\n" for line in src if kept(line))

        try:
            atomic_write_file(self.path, write)
        except OSError as err:
            from megaloop.runtime.files import describe_os_error

            raise MetricsWriteError(f"{self.path}: cannot drop the steps after the checkpoint ({describe_os_error(err)}); "
                                    "the file is as it was") from None

    def log(self, rec: dict[str, Any]) -> None:
        if not self.enabled:
            return
        data = (json.dumps(rec) + "\n").encode()
        pos = os.fstat(self._fd).st_size
        try:
            done = 0
            while done < len(data):  # a short write (a disk filling up) continues; a failed one raises
                done += os.write(self._fd, data[done:])
        except OSError as err:  # no torn line left behind, one line for the user
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, pos)
            from megaloop.runtime.files import describe_os_error

            raise MetricsWriteError(f"{self.path}: step {rec.get('step')} could not be logged "
                                    f"({describe_os_error(err)}); training stops, the last checkpoint is kept") from None
        if self._wandb is not None:
            flat = {k: v for k, v in rec.items() if isinstance(v, (int, float))}
            self._wandb_call(lambda: self._wandb.log(flat, step=rec["step"]), f"step {rec['step']}")
        info = " ".join(f"{k}={rec[k]:.4g}" for k in CONSOLE_KEYS if isinstance(rec.get(k), (int, float)))
        if self._progress is not None:
            self._progress.update(self._task, completed=rec["step"], info=info)
        else:
            print(f"step {rec['step']:>6d} {info}", flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        os.close(self._fd)
        if self._wandb is not None:
            self._wandb_call(self._wandb.finish, "finishing the run")

    def _wandb_call(self, call, what: str) -> None:
        """``call()`` on the wandb run; when wandb fails (its service died, a network error it raises),
        one line on stderr and wandb is off for the rest of this launch: the training run goes on,
        ``metrics.jsonl`` keeps every step. slurm's ``scancel --signal=TERM`` reaches every process of
        the job step, wandb's service (``wandb-core``, which unblocks SIGTERM itself) included; the
        next log or finish raised, and the run ended with exit 1: no checkpoint, no requeue."""
        try:
            call()
        except Exception as err:  # noqa: BLE001 - any wandb failure: the log sink must not stop training
            self._wandb = None
            import wandb

            with contextlib.suppress(Exception):  # its exit hook would print the same error as a traceback
                wandb.teardown()
            print(f"warning: wandb failed at {what} ({type(err).__name__}: {err}); wandb logging is off for the "
                  f"rest of this launch, {self.path} keeps every step", file=sys.stderr, flush=True)


def prior_metrics(sampler, m: dict) -> dict:
    """A step's depth-prior fields: the sampler's mean, entropy and probabilities, and what its
    update ``m`` reports (PopArt scale and baseline, advantages, per-depth CE)."""
    out = {"prior_mean_depth": sampler.mean_depth(), "prior_entropy": sampler.entropy(),
           "prior_probs": [float(f"{float(p):.6g}") for p in sampler.probs()]}  # 6 significant digits: a
    # tail mass below 5e-7 (r_max 64) showed as 0 at 6 decimals, hiding its moves (plot_prior.py --log)
    for k in ("scale", "baseline", "adv_mean", "adv_abs_mean"):
        if k in m:
            out[f"prior_{k}"] = float(m[k])
    if "per_depth_ce" in m:
        out["per_depth_ce"] = {str(k): float(v) for k, v in m["per_depth_ce"].items()}
    return out


def nonfinite_warning(counters: dict, steps: int, streak: int, last: dict | None) -> str | None:
    """The end-of-run line of a run that skipped non-finite steps (``train.nonfinite=skip`` never
    reached ``max_nonfinite`` in a row) or whose final validation CE is not finite; None otherwise."""
    skipped = int(counters.get("skipped_steps_total", 0))
    val = (last or {}).get("val_ce")
    bad_val = isinstance(val, float) and not math.isfinite(val)
    if not skipped and not bad_val:
        return None
    parts = [f"{skipped} of the run's {steps} steps were skipped as non-finite"
             + (f", the last {streak} in a row" if streak else "")] if skipped else []
    parts += ["the final validation CE is not finite"] if bad_val else []
    tail = ": the run diverged or is diverging (lower optim.lr, check the data)" if streak or bad_val else ""
    return f"warning: {'; '.join(parts)}{tail}"


def read_metrics(path: Path) -> list[dict]:
    """Records of a metrics.jsonl (in file order; ``[]`` when absent); a torn line (a live or killed
    run) is ignored."""
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
