"""``depth.init=from:PATH``: start a learned prior from another run's learned distribution.

The paper's S ablation trains "with its final distribution frozen from the first update"
(``depth.init=from:RUN depth.frozen=true``); without ``frozen`` the prior keeps learning from there.
PATH is a run directory (its newest complete checkpoint), a ``checkpoints/`` directory or one
``step_*`` checkpoint, of any TP/PP layout. Only the logits and the active support are taken; the
prior's Adam state and PopArt statistics start fresh (they describe the other run's losses).
Reading checkpoints is the trainer's business: ``megaloop.depth`` only receives the state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megaloop.config_utils import ConfigError
from megaloop.train.checkpoint import CheckpointError, find_checkpoint


def load_prior_init(path: str | Path, r_max: int) -> dict[str, Any]:
    """``{"logits": float64 [r_max], "active": bool [r_max], "checkpoint": str, "step": int}``
    for ``LearnedDepthPrior(cfg, init_state)``.

    Raises ``ConfigError`` naming ``depth.init=from:PATH`` when PATH is missing, holds no complete
    checkpoint, or its checkpoint has no learned prior or one over another support size.
    """
    from megatron.core import dist_checkpointing

    where = f"depth.init=from:{path}"
    if not Path(path).exists():
        raise ConfigError(f"{where}: no such run directory or checkpoint")
    try:
        ckpt = find_checkpoint(path)
        common = dist_checkpointing.load_common_state_dict(str(ckpt))["common"]
    except CheckpointError as err:
        raise ConfigError(f"{where}: {err}") from None
    except Exception as err:  # noqa: BLE001 - any unreadable file is a bad input here
        raise ConfigError(f"{where}: cannot read {path}: {err}") from None
    sampler = (common or {}).get("sampler") or {}
    prior = sampler.get("prior")
    if prior is None:
        raise ConfigError(f"{where}: checkpoint {ckpt} has no learned prior "
                          f"(its depth.kind is {sampler.get('kind', 'unknown')!r})")
    if int(prior["r_max"]) != r_max:
        raise ConfigError(f"{where}: checkpoint {ckpt} has a prior over 1..{prior['r_max']}, "
                          f"depth.r_max is {r_max}")
    return {"logits": torch.as_tensor(prior["logits"], dtype=torch.float64).clone(),
            "active": torch.as_tensor(prior["active"], dtype=torch.bool).clone(),
            "checkpoint": str(ckpt), "step": int(common.get("step", 0))}
