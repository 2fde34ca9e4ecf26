"""First step of tools/gpu_check.sh: describe the machine and import the whole training path.

    python tools/gpu/probe.py OUT.json [--cpu-smoke]

Writes OUT.json (device name, torch/CUDA versions, versions and locations of the shipped and the
image's packages, Transformer Engine availability, /dev/shm size) and exits non-zero with one
line naming what is wrong: no CUDA device (unless --cpu-smoke), or a module of the training path
that does not import (a wheel missing from .whl/, or an incompatible image package).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import sys
import time
import warnings
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

# The modules the three checks import first; each pulls in the rest of its closure.
TRAINING_PATH = ("megatron.core", "megaloop.data.streaming", "streaming", "megaloop.train.trainer",
                 "megaloop.model.looped", "megatron.core.models.gpt")
DISTRIBUTIONS = ("torch", "megatron-core", "mosaicml-streaming", "transformers", "tokenizers", "huggingface_hub",
                 "numpy", "safetensors", "zstd", "brotli", "python-snappy", "cramjam", "catalogue", "xxhash",
                 "transformer-engine", "wandb")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--cpu-smoke", action="store_true", help="do not require a CUDA device")
    args = p.parse_args()
    import torch

    info: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": platform.python_version(),
                  "platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                  "cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                    capability=list(torch.cuda.get_device_capability(0)),
                    device_mem_gib=round(props.total_memory / 2**30, 2),
                    bf16_supported=torch.cuda.is_bf16_supported())
    else:
        info["device"] = "cpu"
    try:
        info["dev_shm_free_mib"] = shutil.disk_usage("/dev/shm").free // 2**20
    except OSError:
        info["dev_shm_free_mib"] = None
    info["packages"] = {d: _version(d) for d in DISTRIBUTIONS}
    errors = []
    if not args.cpu_smoke and not torch.cuda.is_available():
        errors.append(f"no CUDA device visible to torch {torch.__version__} (CUDA build: {torch.version.cuda})")
    where = {}
    for mod in TRAINING_PATH:
        try:
            m = importlib.import_module(mod)
            where[mod] = str(Path(m.__file__).parent) if getattr(m, "__file__", None) else None
        except Exception as err:  # noqa: BLE001 - report every kind of import failure
            errors.append(f"import {mod} failed: {type(err).__name__}: {err}")
    info["module_paths"] = where
    try:  # the trainer's own decision (TE's PyTorch extension importable and CUDA present)
        from megaloop.model.config import ModelConfig
        from megaloop.model.specs import use_transformer_engine

        info["transformer_engine"] = use_transformer_engine(ModelConfig(hidden_size=64, num_heads=4))
    except Exception as err:  # noqa: BLE001
        info["transformer_engine"] = False
        errors.append(f"Transformer Engine check failed: {type(err).__name__}: {err}")
    info["errors"] = errors
    Path(args.out).write_text(json.dumps(info, indent=1))
    print(json.dumps(info))
    if errors:
        raise SystemExit("probe: " + "; ".join(errors))


if __name__ == "__main__":
    main()
