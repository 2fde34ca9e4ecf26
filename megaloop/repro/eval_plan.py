"""What every arm of an experiment is evaluated on (an experiment file's ``eval:``; validated
fields, a stable digest so an arm's evaluation is redone when its plan changes)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from megaloop.config_utils import ConfigError


@dataclass
class EvalPlan:
    """What every arm is evaluated on. ``depth``: the training depth R (native PPL@R, sharing
    penalty at R, reference of the extrapolation); ``depths``: the sweep (its max is the
    extrapolation depth); ``max_seqs``: validation sequences (None: the whole set); ``sweep``:
    run the PPL sweep (needs validation data); ``synth``: held-out synthetic problems (a JSONL of
    ``data_prep/make_synth.py``, or ``shipped``) scored by ``megaloop eval synth`` at every depth,
    accuracy averaged over chain lengths k >= ``synth_min_k``."""

    depth: int = 5
    depths: list[int] = field(default_factory=lambda: [1, 2, 4, 5, 8, 16, 32, 64])
    sharing: bool = True
    data: str = "default"
    max_seqs: int | None = None
    batch_size: int = 4
    harness: list[str] = field(default_factory=lambda: ["megaloop_toy_mc"])
    harness_limit: int | None = None
    sweep: bool = True
    synth: str | None = None
    synth_min_k: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.depth, int) or isinstance(self.depth, bool) or self.depth < 1:
            raise ConfigError(f"eval.depth: must be an integer >= 1, got {self.depth!r}")
        if (not isinstance(self.depths, list) or not self.depths
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in self.depths)):
            raise ConfigError(f"eval.depths: must be a non-empty list of integers >= 1, got {self.depths!r}")
        self.depths = sorted(set(self.depths) | {self.depth})  # the training depth is always a row
        if not isinstance(self.sharing, bool):
            raise ConfigError(f"eval.sharing: expected true/false, got {self.sharing!r}")
        if not isinstance(self.data, str) or not self.data:
            raise ConfigError(f"eval.data: expected 'default' or an MDS validation directory, got {self.data!r}")
        for name in ("max_seqs", "harness_limit"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"eval.{name}: must be an integer >= 1 or null, got {v!r}")
        if not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool) or self.batch_size < 1:
            raise ConfigError(f"eval.batch_size: must be an integer >= 1, got {self.batch_size!r}")
        if not isinstance(self.harness, list) or not all(isinstance(t, str) and t for t in self.harness):
            raise ConfigError(f"eval.harness: must be a list of task names, got {self.harness!r}")
        if not isinstance(self.sweep, bool):
            raise ConfigError(f"eval.sweep: expected true/false, got {self.sweep!r}")
        if self.synth is not None and (not isinstance(self.synth, str) or not self.synth):
            raise ConfigError(f"eval.synth: expected 'shipped' or a held-out problems JSONL, got {self.synth!r}")
        if not isinstance(self.synth_min_k, int) or isinstance(self.synth_min_k, bool) or self.synth_min_k < 1:
            raise ConfigError(f"eval.synth_min_k: must be an integer >= 1, got {self.synth_min_k!r}")
        if not (self.sweep or self.harness or self.synth):
            raise ConfigError("eval: nothing to evaluate (sweep: false, no harness tasks, no synth problems)")

    def to_dict(self) -> dict:
        """The plan's fields; the synthetic-task fields only when used, so plans written before
        they existed keep their digest."""
        d = asdict(self)
        if self.sweep:
            del d["sweep"]
        if self.synth is None:
            del d["synth"], d["synth_min_k"]
        return d

    def digest(self) -> str:
        """Stable hash: an arm's evaluation is redone when the plan changes."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]
