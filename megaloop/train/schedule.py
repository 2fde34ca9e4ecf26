"""Learning-rate schedules via megatron's OptimizerParamScheduler (WSD, cosine, constant)."""

from __future__ import annotations

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megaloop.config import OptimConfig


def build_scheduler(optimizer, cfg: OptimConfig, max_steps: int) -> OptimizerParamScheduler:
    """Scheduler over the ``max_steps`` horizon. WSD = linear warm-up, constant peak, decay over
    the final ``decay_fraction`` of the horizon. The trainer advances it *before* each update,
    so update n (1-based) uses the schedule's value at n (megatron's own loop spends its first
    update at the warm-up's initial LR of 0)."""
    warmup = min(cfg.warmup_steps, max_steps)
    kw = dict(init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=warmup,
              lr_decay_steps=max_steps, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
              wd_incr_steps=max_steps, wd_incr_style="constant",
              use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=False)
    if cfg.schedule == "wsd":
        decay = max(1, round(cfg.decay_fraction * max_steps)) if cfg.decay_fraction > 0 else 0
        return OptimizerParamScheduler(optimizer, lr_decay_style="WSD", wsd_decay_steps=decay,
                                       lr_wsd_decay_style=cfg.decay_style, **kw)
    if cfg.schedule == "cosine":
        return OptimizerParamScheduler(optimizer, lr_decay_style="cosine", **kw)
    return OptimizerParamScheduler(optimizer, lr_decay_style="constant", **kw)
