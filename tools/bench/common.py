"""Shared helpers for benchmarks: model-shape arguments, timing, machine description, JSON results
(``tools/bench/results/``, or ``$MEGALOOP_BENCH_RESULTS`` to keep ad-hoc runs off the committed
files), the command that reproduces a run, single-process megatron."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(os.environ.get("MEGALOOP_BENCH_RESULTS") or ROOT / "tools" / "bench" / "results")
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")


def check_results_dir() -> None:
    """Exit 2 with one line when ``$MEGALOOP_BENCH_RESULTS`` cannot hold a result: called by each
    benchmark right after its options are parsed, not after minutes of timing when it writes it."""
    from megaloop.runtime.files import folder_problem

    if os.environ.get("MEGALOOP_BENCH_RESULTS") and (why := folder_problem(RESULTS)):
        print(f"{Path(sys.argv[0]).name}: error: MEGALOOP_BENCH_RESULTS={RESULTS}: {why}", file=sys.stderr)
        sys.exit(2)


# Option checks: argparse ``type=`` functions, so that a bad value stops the parse with argparse's
# one line ``SCRIPT: error: argument --reps: must be an integer >= 1, got '0'`` (exit 2) before
# anything is built or timed. List options stay the string they were given (results and recorded
# commands keep their format); the script splits them as before.


def int_at_least(minimum: int):
    """``type=`` for an integer option ``>= minimum``."""

    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return check


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def result_name(text: str) -> str:
    """``type=`` for ``--name``: the result's file name under the results folder, not a path."""
    if not text or text in (".", "..") or "/" in text or os.sep in text or "\0" in text:
        raise argparse.ArgumentTypeError(f"must be a file name (no folder; results go to {RESULTS}), got {text!r}")
    return text


def int_in_range(low: int, high: int):
    """``type=`` for an integer option in ``[low, high]``."""

    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer in [{low}, {high}], got {text!r}")
        return value

    return check


def positive_float(text: str) -> float:
    """``type=`` for a finite number ``> 0`` (e.g. a duration in seconds)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def int_list(minimum: int, *, optional: bool = False):
    """``type=`` for a comma-separated list of integers ``>= minimum``, at least one (``optional``: empty
    items are skipped and none is fine, as the script then reads it); returns the string unchanged."""

    def check(text: str) -> str:
        items = [x for x in text.split(",") if x.strip()] if optional else text.split(",")
        try:
            ok = all(int(x) >= minimum for x in items) and (optional or bool(items))
        except ValueError:
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(f"must be comma-separated integers >= {minimum}, got {text!r}")
        return text

    return check


def model_args(p, *, seq: int, batch: int, hidden: int = 256, heads: int = 4, vocab: int = 4096) -> None:
    """The model-shape options every model benchmark takes (defaults per benchmark); after parsing,
    :func:`check_model_args` (``parse_megatron_bench`` calls it)."""
    p.add_argument("--hidden", type=positive_int, default=hidden)
    p.add_argument("--heads", type=positive_int, default=heads)
    p.add_argument("--seq", type=int_at_least(2), default=seq)
    p.add_argument("--batch", type=positive_int, default=batch)
    p.add_argument("--vocab", type=positive_int, default=vocab)


def check_model_args(p, args) -> None:
    """Refuse (``p.error``, exit 2) a ``--hidden`` that ``--heads`` does not divide."""
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden}: not divisible by --heads {args.heads}")


@contextmanager
def user_errors(p):
    """Build a benchmark's model / data inside this: megaloop's :class:`~megaloop.errors.UserError`
    (``ConfigError``, ``DataError``, ``CheckpointError``, ...: bad input, its message naming the field
    or file) becomes one line ``SCRIPT: error: MESSAGE`` on stderr and exit status 2, like the
    ``megaloop`` commands. Anything else (a bug) keeps its traceback."""
    from megaloop.errors import UserError, report

    try:
        yield
    except UserError as err:
        sys.exit(report(err, p.prog))


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def timed(fn) -> float:
    """Seconds one call of ``fn`` takes, GPU work included."""
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def command(script: str, args) -> str:
    """The command line that reproduces a run with the parsed ``args`` (flags for true booleans)."""
    parts = [f"python tools/bench/{script}"]
    for k, v in vars(args).items():
        flag = "--" + k.replace("_", "-")
        if v is None:  # an unset option keeps its default
            continue
        if isinstance(v, bool):
            parts += [flag] if v else []
        elif isinstance(v, (list, tuple)):
            parts += [flag, *map(str, v)]
        else:
            parts += [flag, str(v)]
    return " ".join(parts)


def machine() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "platform": platform.platform(), "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_result(name: str, config: dict, results, command: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    from megaloop.model.config import ModelConfig

    # the model defaults' revision (ModelConfig.DEFAULTS_REVISION: 2 = QK-norm on by default)
    out.write_text(json.dumps({"benchmark": name, "date": time.strftime("%Y-%m-%d"), "machine": machine(),
                               "model_defaults_revision": ModelConfig.DEFAULTS_REVISION,
                               "config": config, "command": command, "results": results}, indent=1))
    print(f"wrote {out}")
    return out


def sync() -> None:
    """Wait for queued GPU work (no-op on CPU) before reading a timer."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def export_model_args(p, name: str) -> None:
    """Options of the benchmarks that time the export (pure-PyTorch) model."""
    from megaloop.hf.configuration_megaloop import INJECTIONS

    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--injection", default="parcae_nonorm", choices=INJECTIONS)
    p.add_argument("--name", type=result_name, default=name)


def export_model(args):
    """A seeded random ``MegaloopForCausalLM`` of the ``model_args`` shape in eval mode on the
    benchmark device (``args.threads`` CPU threads); returns ``(model, device)``."""
    import torch

    from megaloop.hf.configuration_megaloop import MegaloopConfig
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM

    torch.set_num_threads(args.threads)
    dev = device()
    torch.manual_seed(0)
    cfg = MegaloopConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_attention_heads=args.heads,
                         injection=args.injection, max_position_embeddings=args.seq)
    return MegaloopForCausalLM(cfg).to(dev).eval(), dev


def native_model(cfg, vocab: int, seed: int = 0):
    """A single-process (TP=PP=1) native ``LoopedGPT`` of ``ModelConfig`` ``cfg``."""
    from megaloop.model.looped import LoopedGPT
    from megaloop.model.specs import transformer_config

    tc = transformer_config(cfg, tp=1, pp=1, vpp=None, sequence_parallel=False)
    return LoopedGPT(cfg, tc, vocab_size=vocab, seed=seed)


def parse_megatron_bench(p):
    """Add ``--bf16``, parse (:func:`check_model_args`), start single-process megatron; returns
    ``(args, device, dtype)``."""
    import torch

    p.add_argument("--bf16", action="store_true")
    args = p.parse_args()
    check_results_dir()
    check_model_args(p, args)
    single_process_megatron()
    return args, device(), torch.bfloat16 if args.bf16 else torch.float32


def single_process_megatron(seed: int = 1234) -> None:
    from megaloop.runtime.parallel import ParallelDims, init_distributed

    init_distributed(ParallelDims(world=1), seed=seed)
