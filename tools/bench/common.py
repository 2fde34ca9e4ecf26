"""Shared helpers for benchmarks: model-shape arguments, timing, machine description, JSON results
(``tools/bench/results/``, or ``$MEGALOOP_BENCH_RESULTS`` to keep ad-hoc runs off the committed
files), the command that reproduces a run, single-process megatron."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(os.environ.get("MEGALOOP_BENCH_RESULTS") or ROOT / "tools" / "bench" / "results")
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")


def model_args(p, *, seq: int, batch: int, hidden: int = 256, heads: int = 4, vocab: int = 4096) -> None:
    """The model-shape options every model benchmark takes (defaults per benchmark)."""
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--heads", type=int, default=heads)
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--vocab", type=int, default=vocab)


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
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--injection", default="parcae_nonorm")
    p.add_argument("--name", default=name)


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
    """Add ``--bf16``, parse, start single-process megatron; returns ``(args, device, dtype)``."""
    import torch

    p.add_argument("--bf16", action="store_true")
    args = p.parse_args()
    single_process_megatron()
    return args, device(), torch.bfloat16 if args.bf16 else torch.float32


def single_process_megatron(seed: int = 1234) -> None:
    from megaloop.runtime.parallel import ParallelDims, init_distributed

    init_distributed(ParallelDims(world=1), seed=seed)
