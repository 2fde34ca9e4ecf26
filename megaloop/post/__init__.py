"""DeepSpeed ZeRO glue for the post-training stages that run on the HF model (``megaloop rl``,
``megaloop distill-prefill``): config loading/validation (:mod:`.ds_config`) and one optimizer
interface over a plain single-process AdamW or a DeepSpeed engine (:mod:`.engine`); run folders and
checkpoint facts (:mod:`.runs`); the graceful stop on SIGTERM/SIGUSR1/Ctrl-C (:mod:`.stop`: checkpoint,
exit 75/130). Pretraining stays on megatron-core."""


from __future__ import annotations

import importlib
from typing import Any

# loaded lazily, so that megaloop.post.runs (folder checks of the sweep commands too) does not import torch
_LAZY = {"STAGES": "ds_config", "load_ds_config": "ds_config", "shipped_config": "ds_config",
         "DeepSpeedEngine": "engine", "PlainEngine": "engine", "PostEngine": "engine", "dist_info": "engine",
         "init_post_distributed": "engine"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"megaloop.post.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'megaloop.post' has no attribute {name!r}")
