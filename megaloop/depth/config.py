"""Config of the training-depth distribution and the learned depth prior (SPEC §4–§5)."""

from __future__ import annotations

from dataclasses import dataclass

from megaloop.config_utils import require

DEPTH_KINDS = ("fixed", "pln", "learned", "poisson")
PRIOR_INITS = ("pln", "uniform", "uniform_1_10")  # or "from:PATH" (another run's learned prior)
INIT_FROM = "from:"
REWARD_ARMS = ("exp", "neglog", "negexp", "raw_ce")
CORRELATIONS = ("microbatch", "step")
MAX_DEPTH = 1024  # bound on depth.cap, depth.r_max and depth.depth (a choice: see __post_init__)


@dataclass
class DepthConfig:
    """How each microbatch's recurrence depth is drawn.

    kind: ``fixed`` (always ``depth``), ``pln`` (Poisson-lognormal, mean ``mean`` exactly after the
    cap), ``learned`` (categorical prior over 1..``r_max`` updated from per-microbatch CE), or
    ``poisson`` (``min(max(Poisson(mean), 1), cap)``: Parcae's trainer's law, for reference-matched
    runs; ``mean`` is the Poisson rate, so E[R] = mean + e^-mean before the cap; not a paper arm).
    """

    kind: str = "pln"
    depth: int = 5  # fixed depth
    mean: float = 5.0  # PLN mean after capping (poisson: the rate; learned init=pln: the init's mean)
    sigma: float = 0.5  # PLN log-normal std
    cap: int = 64  # PLN / poisson cap
    r_max: int = 64  # learned prior support 1..r_max
    init: str = "pln"  # learned prior init: pln | uniform | uniform_1_10 | from:RUN_DIR_OR_CHECKPOINT
    reward: str = "exp"  # exp (= exp(-ℓ), default) | neglog | negexp | raw_ce
    entropy_coef: float = 0.01  # λ_H
    mean_coef: float = 1.0  # λ_m
    target_mean: float = 5.0  # R̄
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    warmup_updates: int = 32
    ema_decay: float = 0.95  # ν
    frozen: bool = False
    # microbatch: one independent draw per microbatch (SPEC §4, the paper's runs); step: one draw per
    # optimizer step shared by all its microbatches (as Huginn's and Parcae's trainers do)
    correlation: str = "microbatch"

    def __post_init__(self) -> None:
        require(self.kind in DEPTH_KINDS, "depth.kind", f"unknown kind {self.kind!r}; one of {DEPTH_KINDS}")
        require(self.depth >= 1, "depth.depth", f"must be >= 1, got {self.depth}")
        # bounds (choices): a training depth past 1024 recurrences, or a lognormal spread past 3 (SPEC: 0.5),
        # only made the sampler's tables and PLN's mean solve run out of memory or time
        require(1 <= self.cap <= MAX_DEPTH, "depth.cap", f"must be in [1, {MAX_DEPTH}], got {self.cap}")
        require(0 < self.sigma <= 3, "depth.sigma", f"must be in (0, 3], got {self.sigma}")
        require(self.depth <= MAX_DEPTH, "depth.depth", f"must be <= {MAX_DEPTH}, got {self.depth}")
        # PLN needs mean > 1 strictly: mean 1 is a point mass (use kind=fixed), and every mass must be > 0.
        require(1.0 < self.mean < self.cap or self.kind != "pln", "depth.mean",
                f"must lie in (1, cap={self.cap}), got {self.mean}")
        require(self.mean > 0 or self.kind != "poisson", "depth.mean",
                f"poisson: the rate must be > 0, got {self.mean}")
        require(self.cap >= 2 or self.kind != "poisson", "depth.cap", f"poisson: must be >= 2, got {self.cap}")
        require(1 <= self.r_max <= MAX_DEPTH, "depth.r_max", f"must be in [1, {MAX_DEPTH}], got {self.r_max}")
        require(self.init in PRIOR_INITS or (self.init_from is not None and self.init_from != ""), "depth.init",
                f"unknown init {self.init!r}; one of {PRIOR_INITS} or {INIT_FROM}PATH (a run dir or checkpoint)")
        require(self.init_from is None or self.kind == "learned", "depth.init",
                f"{self.init!r} starts a learned prior from another run; it needs depth.kind=learned, got {self.kind!r}")
        require(self.correlation in CORRELATIONS, "depth.correlation",
                f"unknown correlation {self.correlation!r}; one of {CORRELATIONS}")
        require(self.reward in REWARD_ARMS, "depth.reward", f"unknown reward {self.reward!r}; one of {REWARD_ARMS}")
        require(self.lr > 0, "depth.lr", f"must be > 0, got {self.lr}")
        require(0.0 <= self.ema_decay < 1.0, "depth.ema_decay", f"must be in [0, 1), got {self.ema_decay}")
        require(self.warmup_updates >= 0, "depth.warmup_updates", "must be >= 0")
        require(self.entropy_coef >= 0, "depth.entropy_coef", f"must be >= 0, got {self.entropy_coef}")
        require(self.mean_coef >= 0, "depth.mean_coef", f"must be >= 0, got {self.mean_coef}")
        require(0.0 <= self.beta1 < 1.0, "depth.beta1", f"must be in [0, 1), got {self.beta1}")
        require(0.0 <= self.beta2 < 1.0, "depth.beta2", f"must be in [0, 1), got {self.beta2}")
        if self.kind == "learned":
            require(self.init != "uniform_1_10" or self.r_max >= 10, "depth.r_max",
                    f"init=uniform_1_10 needs r_max >= 10, got {self.r_max}")
            require(self.init != "uniform_1_10" or self.target_mean <= 10, "depth.target_mean",
                    f"init=uniform_1_10 keeps the prior on depths 1..10, so a target mean of {self.target_mean:g} "
                    "cannot be reached (the mean penalty piles the prior onto depth 10); give one <= 10")
            require(self.init != "pln" or 1.0 < self.mean < self.r_max, "depth.mean",
                    f"init=pln needs a PLN mean in (1, r_max={self.r_max}), got {self.mean}")
            require(self.init != "pln" or self.r_max >= 2, "depth.r_max", "init=pln needs r_max >= 2")
            require(1.0 <= self.target_mean <= self.r_max, "depth.target_mean",
                    f"must lie in [1, r_max={self.r_max}], got {self.target_mean}")

    @property
    def init_from(self) -> str | None:
        """PATH of ``init=from:PATH`` (None for the built-in inits)."""
        return self.init[len(INIT_FROM):].strip() if self.init.startswith(INIT_FROM) else None

    @property
    def max_depth(self) -> int:
        """Largest depth this distribution can draw."""
        return {"fixed": self.depth, "pln": self.cap, "poisson": self.cap, "learned": self.r_max}[self.kind]
