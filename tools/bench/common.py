"""Shared helpers for benchmarks: machine description, JSON results, single-process megatron."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "tools" / "bench" / "results"
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")


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
    out.write_text(json.dumps({"benchmark": name, "date": time.strftime("%Y-%m-%d"), "machine": machine(),
                               "config": config, "command": command, "results": results}, indent=1))
    print(f"wrote {out}")
    return out


def sync() -> None:
    """Wait for queued GPU work (no-op on CPU) before reading a timer."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def single_process_megatron(seed: int = 1234) -> None:
    from megaloop.runtime.parallel import ParallelDims, init_distributed

    init_distributed(ParallelDims(world=1), seed=seed)
