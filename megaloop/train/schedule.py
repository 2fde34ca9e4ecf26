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


def lr_at(cfg: OptimConfig, max_steps: int, step: int) -> float:
    """The LR update ``step`` (1-based) gets under a ``max_steps`` horizon (no optimizer needed)."""
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    sched = build_scheduler(opt, cfg, max_steps)
    sched.step(increment=step)
    return float(opt.param_groups[0]["lr"])


def check_horizon_change(cfg: OptimConfig, old_horizon: int, new_horizon: int, step: int) -> str | None:
    """Whether a run saved at ``step`` under ``old_horizon`` can continue under ``new_horizon``.

    The schedule is a function of (step, horizon). Changing the horizon is honoured when the run's
    past is the new schedule's too: the LR its last update (``step``) ran at is what the new horizon
    gives that update (for WSD: the step is in warm-up or in the stable phase under both, so the run
    keeps the peak and decays over the last ``decay_fraction`` of the *new* horizon; the checkpoint
    saved at the last stable step, the usual WSD branch point, qualifies; for cosine: still in
    warm-up), or when the next update's LR is the same under both horizons. Otherwise (a run already in its decay, a new horizon whose decay would already have
    begun, a cosine run past its warm-up, a horizon at or before the step) the message says why,
    naming both horizons; None = honour the new horizon."""
    if new_horizon == old_horizon:
        return None
    if new_horizon <= step:
        return (f"train.max_steps={new_horizon} is not past the checkpoint's step {step} "
                f"(checkpoint horizon {old_horizon}): nothing left to train")
    tol = 1e-9 * max(cfg.lr, 1e-30)
    old_lr, new_lr = lr_at(cfg, old_horizon, step), lr_at(cfg, new_horizon, step)
    if abs(old_lr - new_lr) <= tol:
        return None
    if abs(lr_at(cfg, old_horizon, step + 1) - lr_at(cfg, new_horizon, step + 1)) <= tol:
        return None  # the next update's LR is the same either way (e.g. a finished decay at min_lr)
    if cfg.schedule != "wsd":
        where = f"past the warm-up of its {cfg.schedule} schedule"
    elif abs(old_lr - cfg.lr) > 1e-9 * max(cfg.lr, 1e-30):
        where = "in its decay phase"
    else:
        where = "in its stable phase, where the new horizon's decay would already have begun"
    keep = (f"Resume with train.max_steps={old_horizon}, or" if step < old_horizon else
            "The run has finished its schedule: start a new run from its weights (train.init_weights), or")
    return (f"train.max_steps={new_horizon} differs from the checkpoint's horizon {old_horizon}, and the run "
            f"at step {step} is {where}: its update {step} ran at LR {old_lr:.3g}, the new horizon's schedule "
            f"gives {new_lr:.3g} there. {keep} change the horizon from a checkpoint saved before the decay "
            f"(up to its last stable step)")
