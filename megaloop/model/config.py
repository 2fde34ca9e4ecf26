"""Model config: looped (prelude → shared core × R → coda) or untied baseline (SPEC §1–§3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megaloop.config_utils import require

INJECTIONS = ("huginn_linear", "parcae_decay", "parcae_nonorm", "orthoinj", "deq_qkv", "orthoinj_early")
STATE_INITS = ("normal", "zero")
ARCHS = ("looped", "untied")
ADAPTER_INITS = ("torch", "normal")
IMPLS = ("auto", "local", "transformer_engine")
LOCAL_ATTENTION = ("sdpa", "megatron")
FP8_FORMATS = ("hybrid", "e4m3")
# tensorwise (current scaling) is the default: delayed scaling reduces amaxes over the amax group at
# every fp8_autocast exit, i.e. once per layer *visit* here (the core runs R times per step)
FP8_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")


@dataclass
class ModelConfig:
    """Shapes and recipe of the model. Widths in channels, lengths in tokens.

    ``arch=looped``: ``n_prelude`` layers, one weight-shared core of ``n_core`` layers applied
    ``r`` times (``r`` drawn per microbatch), ``n_coda`` layers. ``arch=untied``: a plain
    ``num_layers``-layer transformer from the same code (``Untied-N`` baselines).
    """

    RENAMED: ClassVar[dict[str, str]] = {"b_max": "bptt_window"}  # older configs and checkpoints
    # what a saved model config that lacks a field (written before the field existed) trained with
    LEGACY_DEFAULTS: ClassVar[dict[str, object]] = {"embed_scale": 1.0, "qk_norm": False}
    # defaults revision: bumped when a default changes the model; PREVIOUS_DEFAULTS[r] is a snapshot
    # of revision r's values that differ from today's (reproduce results record their revision, so
    # arms recorded as overrides resolve to the model they trained)
    DEFAULTS_REVISION: ClassVar[int] = 2
    PREVIOUS_DEFAULTS: ClassVar[dict[int, dict[str, object]]] = {1: {"qk_norm": False}}
    # fields that define the model's function: a checkpoint resumes only under the same values (and the
    # widths num_query_groups / ffn_hidden_size, compared as resolved: None and its value are the same)
    ARCH_FIELDS: ClassVar[tuple[str, ...]] = (
        "arch", "hidden_size", "num_heads", "n_prelude", "n_core",
        "n_coda", "num_layers", "injection", "exit_norm", "qk_norm", "qk_norm_gain", "qk_bias",
        "sandwich_norm", "input_norm", "state_readout", "state_final_norm", "tie_embeddings",
        "embed_scale", "adapter_bias")
    # they change what the weights compute too, but a run that starts from other weights may change
    # them on purpose (context extension: a longer seq_len with a larger RoPE base): resume only
    RESUME_FIELDS: ClassVar[tuple[str, ...]] = ("rope_base", "norm_eps")

    arch: str = "looped"
    hidden_size: int = 256
    num_heads: int = 4
    num_query_groups: int | None = None  # GQA groups; None = num_heads (MHA)
    ffn_hidden_size: int | None = None  # None = SwiGLU width round_up(8/3·d, 64)
    n_prelude: int = 1
    n_core: int = 2
    n_coda: int = 1
    num_layers: int = 4  # untied only
    vocab_size: int = 0  # 0 = taken from the data's tokenizer manifest
    vocab_pad_multiple: int = 128  # padded vocab is a multiple of this (independent of TP)
    seq_len: int = 256
    injection: str = "parcae_nonorm"
    # huginn_linear's parameter-free core-exit RMSNorm; false = the paper's "without exit
    # normalization" diagnostic (S PLN-25 diverged at every tested LR). Only huginn_linear has one.
    exit_norm: bool = True
    state_init: str = "normal"  # training-time h^0: N(0, state_init_std²) or zeros
    state_init_std: float = 0.02  # SPEC §1 says init_std; kept apart, see README "Deviations from SPEC"
    eval_state_init: str = "normal"
    eval_seed: int = 0  # fixed seed of the evaluation-time Gaussian state init
    # weight init std: a number, or "small" = √(2/(5·hidden_size)) (Nguyen & Salazar's "small init",
    # the std Huginn's and Parcae's code use; 0.056 at d=128, 0.020 at d=1024). Default chosen by the
    # learning-parity ablations (README "Learning parity"): 0.02 at d=128 cost 0.18 nats at 300 steps
    init_std: float | str = "small"
    # orthogonal instead of normal weight init at the same per-entry scale: each matrix (fused
    # QKV and SwiGLU fc1 as one) is orthogonal with gain std·√max(rows, cols) (Parcae's init_orthogonal)
    init_orthogonal: bool = False
    # with init_orthogonal: megatron's fused QKV matrix is initialised as three separate orthogonal
    # matrices q [heads·head_dim, d], k and v [groups·head_dim, d], each at gain std·√max(rows, cols)
    # and laid out in megatron's per-group order (Parcae's separate c_q / c_k / c_v). Local spec only
    qkv_init_split: bool = False
    deq_std: float = 0.02  # σ of DEQ-QKV injection projections
    # huginn_linear's adapter W_in [h; e; 1]: "torch" = torch's default Linear init with a bias (the
    # recipe's "default linear init", SPEC §2); "normal" = the weight init of every other matrix
    # (init_std; orthogonal with init_orthogonal). adapter_bias=false drops the bias (Huginn's code
    # uses "normal" without a bias)
    adapter_init: str = "torch"
    adapter_bias: bool = True
    bptt_window: int = 10  # TBPTT window cap: b = min(r, bptt_window)
    rope_base: float = 10000.0
    tie_embeddings: bool = False
    # multiplier on the embedding output: a number, or "sqrt_d" (√hidden_size, Huginn's/Gemma's scale).
    # Default sqrt_d (with init_std=small the residual stream starts at RMS √(2/5) ≈ 0.63): the
    # largest single gain of the parity ablations (README "Learning parity")
    embed_scale: float | str = "sqrt_d"
    # std of the residual-output projections (attention out, MLP down); null = megatron's
    # init_std/√(2·physical layers); 0 = zero init (Parcae's "scaled-zero")
    out_init_std: float | None = None
    # RMSNorm (learned gains) on each head's queries and keys before RoPE. Default on: the paper is
    # silent, and at `tiny`/800 steps it lowers the loss at every init draw (3.405 ± 0.004 vs
    # 3.434 ± 0.007) and raises the R=1→5 gain (README "Learning parity"); false = plain attention
    qk_norm: bool = True
    # false: the QK-norm gains stay at 1 and are not trained (Parcae's weightless F.rms_norm on q and
    # k; the weights are kept, frozen, so checkpoints and exports keep their layout). Needs qk_norm
    qk_norm_gain: bool = True
    # Huginn's QK biases: learned per-head biases on queries and keys (zero-init, no weight decay),
    # added after the projection (and QK-norm) and before RoPE. No value bias (megatron's add_qkv_bias
    # would add one)
    qk_bias: bool = False
    # Huginn's sandwich blocks: the residual stream is renormalised after each residual add,
    # x <- RMSNorm(x + attn(RMSNorm(x))), x <- RMSNorm(x + mlp(RMSNorm(x))), learned gains; every layer
    sandwich_norm: bool = False
    # learned-gain RMSNorm on the prelude output e where the injection reads it (Parcae's
    # prelude_norm). parcae_decay always has it (its recipe); deq_qkv reads e in its core layers
    input_norm: bool = False
    # learned d×d projection of the final recurrent state before the coda, y = C h^R (Parcae's
    # readout C): initialised like the other weight matrices (init_std; orthogonal with
    # init_orthogonal), no weight decay. Off = C = I, the paper's recipes
    state_readout: bool = False
    # the final RMSNorm (the same module and weight as before the head) also applied to the final
    # recurrent state before the readout/coda: y = coda(C·RMSNorm_g(h^R)), logits = head(RMSNorm_g(y))
    # (Huginn's code: its iterate_forward returns ln_f(h), then the coda, then ln_f again). Off in
    # the paper's recipes
    state_final_norm: bool = False
    norm_eps: float = 1e-5
    transformer_impl: str = "auto"  # auto = transformer_engine when CUDA + TE, else local
    local_attention: str = "sdpa"  # local spec's core attention: sdpa (torch fused) | megatron (explicit scores)
    fp8: str | None = None  # hybrid | e4m3 (needs TE and an FP8-capable GPU)
    fp8_recipe: str = "tensorwise"  # TE scaling recipe (megatron's fp8_recipe); see FP8_RECIPES
    recompute: bool = False  # full activation recomputation of every layer visit that backpropagates
    bf16: bool = False  # bf16 params/compute with fp32 main params in the optimizer

    def __post_init__(self) -> None:
        require(self.arch in ARCHS, "model.arch", f"unknown arch {self.arch!r}; one of {ARCHS}")
        require(self.hidden_size > 0, "model.hidden_size", "must be > 0")
        require(self.num_heads > 0, "model.num_heads", "must be > 0")
        require(self.hidden_size % self.num_heads == 0, "model.num_heads",
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        head = self.hidden_size // self.num_heads  # rotary embeddings rotate pairs of channels
        require(head % 2 == 0, "model.hidden_size", f"the head size hidden_size/num_heads = {self.hidden_size}/"
                f"{self.num_heads} = {head} must be even (rotary position embeddings rotate channel pairs)")
        require(self.ffn_hidden_size is None or self.ffn_hidden_size > 0, "model.ffn_hidden_size",
                f"must be > 0, or null for the SwiGLU width, got {self.ffn_hidden_size}")  # 0 ran at the default
        if self.num_query_groups is not None:
            require(self.num_query_groups > 0 and self.num_heads % self.num_query_groups == 0,
                    "model.num_query_groups", f"must divide num_heads {self.num_heads}")
        require(self.injection in INJECTIONS, "model.injection",
                f"unknown injection {self.injection!r}; one of {INJECTIONS}")
        require(self.exit_norm or self.injection == "huginn_linear", "model.exit_norm",
                f"only huginn_linear has a core-exit norm to switch off (injection={self.injection!r})")
        for f in ("state_init", "eval_state_init"):
            require(getattr(self, f) in STATE_INITS, f"model.{f}", f"one of {STATE_INITS}")
        if isinstance(self.init_std, str):
            require(self.init_std == "small", "model.init_std", f"a number or 'small', got {self.init_std!r}")
        else:
            require(float(self.init_std) > 0, "model.init_std", f"must be > 0, got {self.init_std}")
        if isinstance(self.embed_scale, str):
            require(self.embed_scale == "sqrt_d", "model.embed_scale",
                    f"a number or 'sqrt_d', got {self.embed_scale!r}")
        else:
            require(float(self.embed_scale) > 0, "model.embed_scale", f"must be > 0, got {self.embed_scale}")
        require(self.out_init_std is None or self.out_init_std >= 0, "model.out_init_std",
                f"must be >= 0 or null, got {self.out_init_std}")
        require(not self.input_norm or self.injection not in ("parcae_decay", "deq_qkv"), "model.input_norm",
                f"not available for injection={self.injection!r} (parcae_decay always normalises e; "
                "deq_qkv injects e inside the core layers)")
        require(self.qk_norm_gain or self.qk_norm, "model.qk_norm_gain",
                "false fixes the QK-norm gains at 1; it needs model.qk_norm=true")
        require(not self.qkv_init_split or self.init_orthogonal, "model.qkv_init_split",
                "splits the orthogonal init of the fused QKV matrix: needs model.init_orthogonal=true")
        require(not self.state_readout or self.arch == "looped", "model.state_readout",
                "only a looped model has a recurrent state to read out (arch=untied)")
        require(not self.state_final_norm or self.arch == "looped", "model.state_final_norm",
                "only a looped model has a recurrent state to normalise (arch=untied)")
        require(self.adapter_init in ADAPTER_INITS, "model.adapter_init", f"one of {ADAPTER_INITS}")
        require((self.adapter_init == "torch" and self.adapter_bias) or self.injection == "huginn_linear",
                "model.adapter_init", f"adapter_init/adapter_bias apply to huginn_linear's adapter only "
                f"(injection={self.injection!r})")
        require(self.bptt_window >= 1, "model.bptt_window", f"must be >= 1, got {self.bptt_window}")
        require(2 <= self.seq_len <= 1 << 22, "model.seq_len", f"must be in [2, 4194304], got {self.seq_len}")
        require(self.rope_base > 0, "model.rope_base", f"must be > 0, got {self.rope_base}")
        require(self.norm_eps > 0, "model.norm_eps", f"must be > 0, got {self.norm_eps}")
        require(self.state_init_std >= 0, "model.state_init_std", f"must be >= 0, got {self.state_init_std}")
        require(self.deq_std >= 0, "model.deq_std", f"must be >= 0, got {self.deq_std}")
        require(self.vocab_size >= 0, "model.vocab_size", "must be >= 0 (0 = from tokenizer)")
        require(self.vocab_pad_multiple >= 1, "model.vocab_pad_multiple", "must be >= 1")
        require(self.transformer_impl in IMPLS, "model.transformer_impl", f"one of {IMPLS}")
        require(self.local_attention in LOCAL_ATTENTION, "model.local_attention", f"one of {LOCAL_ATTENTION}")
        require(self.fp8 is None or self.fp8 in FP8_FORMATS, "model.fp8", f"null or one of {FP8_FORMATS}")
        require(self.fp8_recipe in FP8_RECIPES, "model.fp8_recipe", f"one of {FP8_RECIPES}")
        if self.fp8:  # TE FP8 GEMMs need feature dims that are multiples of 16 (SwiGLU width per TP rank: specs)
            require(self.hidden_size % 16 == 0, "model.fp8", f"hidden_size {self.hidden_size} must be a multiple of 16")
        require(not (self.recompute and self.fp8), "model.recompute",
                "not supported with model.fp8 (a recomputed forward would update FP8 scaling statistics twice)")
        if self.arch == "looped":
            require(self.n_prelude >= 0, "model.n_prelude", "must be >= 0")
            require(self.n_core >= 1, "model.n_core", "a looped model needs n_core >= 1")
            require(self.n_coda >= 0, "model.n_coda", "must be >= 0")
        else:
            require(self.num_layers >= 1, "model.num_layers", "must be >= 1")

    @property
    def looped(self) -> bool:
        return self.arch == "looped"

    @property
    def init_std_value(self) -> float:
        """The weight init std (``init_std`` resolved)."""
        return (2.0 / (5.0 * self.hidden_size)) ** 0.5 if self.init_std == "small" else float(self.init_std)

    @property
    def embedding_multiplier(self) -> float:
        """The embedding output's multiplier (``embed_scale`` resolved)."""
        return self.hidden_size ** 0.5 if self.embed_scale == "sqrt_d" else float(self.embed_scale)

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or swiglu_width(self.hidden_size)

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_heads

    @property
    def physical_layers(self) -> int:
        return self.n_prelude + self.n_core + self.n_coda if self.looped else self.num_layers

    def padded_vocab(self, vocab_size: int | None = None) -> int:
        v = vocab_size or self.vocab_size
        m = self.vocab_pad_multiple
        return -(-v // m) * m

    def validate_parallel(self, tp: int, sequence_parallel: bool) -> None:
        """Check the shapes against a tensor-parallel degree; errors name the field."""
        require(self.num_heads % tp == 0, "model.num_heads",
                f"{self.num_heads} heads are not divisible by parallel.tp={tp}")
        require(self.groups % tp == 0 or tp % self.groups == 0, "model.num_query_groups",
                f"{self.groups} query groups do not split over parallel.tp={tp}")
        require(self.ffn_size % tp == 0, "model.ffn_hidden_size",
                f"{self.ffn_size} is not divisible by parallel.tp={tp}")
        require(self.vocab_pad_multiple % tp == 0, "model.vocab_pad_multiple",
                f"{self.vocab_pad_multiple} is not divisible by parallel.tp={tp}")
        require(not self.qk_bias or self.groups % tp == 0, "model.qk_bias",
                f"the key biases split with the {self.groups} query groups, which parallel.tp={tp} does not divide")
        if sequence_parallel:
            require(self.seq_len % tp == 0, "model.seq_len",
                    f"{self.seq_len} is not divisible by parallel.tp={tp} (sequence parallel)")


def with_legacy_defaults(saved: dict) -> dict:
    """A saved model config dict with the fields it lacks (written before they existed) set to what
    such runs trained with (``ModelConfig.LEGACY_DEFAULTS``), not to today's defaults."""
    return {**ModelConfig.LEGACY_DEFAULTS, **saved}


def arch_differences(saved: dict, cfg: ModelConfig, resume: bool = True) -> list[tuple[str, object, object]]:
    """``(field, saved, current)`` for each of ``ModelConfig.ARCH_FIELDS`` (and, for a ``resume``, of
    ``RESUME_FIELDS``) that ``cfg``'s architecture uses and where the saved model config dict (a
    checkpoint's) differs from ``cfg``. A field the
    saved config lacks counts as its ``LEGACY_DEFAULTS`` value (skipped if it has none); renamed
    fields are read under today's name; ``embed_scale`` compares the multiplier ("sqrt_d" = √d)."""
    saved = with_legacy_defaults({ModelConfig.RENAMED.get(k, k): v for k, v in saved.items()})
    looped = ("n_prelude", "n_core", "n_coda", "injection", "exit_norm", "input_norm", "state_readout",
              "state_final_norm", "adapter_bias")
    skip = set(looped) if cfg.arch == "untied" else {"num_layers"}  # fields this architecture ignores
    if cfg.injection != "huginn_linear":
        skip |= {"exit_norm", "adapter_bias"}
    out = []
    for name in ModelConfig.ARCH_FIELDS + (ModelConfig.RESUME_FIELDS if resume else ()):
        if name in skip or name not in saved:
            continue
        old, new = saved[name], getattr(cfg, name)
        if name == "embed_scale":  # "sqrt_d" and its value are the same multiplier
            same = _multiplier(old, cfg.hidden_size) == cfg.embedding_multiplier
        else:
            same = old == new
        if not same:
            out.append((name, old, new))
    # widths, compared as resolved (None = MHA / the SwiGLU default of the saved hidden size)
    if "num_heads" in saved:
        groups = saved.get("num_query_groups") or saved["num_heads"]
        if groups != cfg.groups:
            out.append(("num_query_groups", groups, cfg.groups))
    if "hidden_size" in saved:
        ffn = saved.get("ffn_hidden_size") or swiglu_width(saved["hidden_size"])
        if ffn != cfg.ffn_size:
            out.append(("ffn_hidden_size", ffn, cfg.ffn_size))
    return out


def swiglu_width(hidden_size: int) -> int:
    """The default SwiGLU width: round_up(8/3 · d, 64)."""
    return -(-int(8 * hidden_size / 3) // 64) * 64


def as_override(name: str, value: object) -> str:
    """``model.<name>=<value>`` as the command line spells it (booleans lower-case)."""
    return f"model.{name}={str(value).lower() if isinstance(value, bool) else value}"


def describe_differences(diffs: list[tuple[str, object, object]], then: str, now: str) -> str:
    """``arch_differences`` as one clause: ``model.k: <then> old, <now> new; ...``."""
    return "; ".join(f"model.{k}: {then} {old!r}, {now} {new!r}" for k, old, new in diffs)


def _multiplier(embed_scale: object, hidden_size: int) -> float | None:
    if embed_scale == "sqrt_d":
        return hidden_size ** 0.5
    try:
        return float(embed_scale)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def param_count(cfg: ModelConfig, vocab_size: int) -> dict[str, int]:
    """Analytic parameter counts (padded vocab): embedding, per-layer, injection, head, total."""
    d, f = cfg.hidden_size, cfg.ffn_size
    kv = d * cfg.groups // cfg.num_heads
    hd = d // cfg.num_heads
    layer = (d * (d + 2 * kv) + d * d + 3 * d * f + 2 * d + (2 * hd if cfg.qk_norm else 0)  # qkv, proj, SwiGLU, norms
             + (2 * d if cfg.sandwich_norm else 0) + (d + kv if cfg.qk_bias else 0))
    v = cfg.padded_vocab(vocab_size)
    emb = v * d
    head = 0 if cfg.tie_embeddings else v * d
    inj = 0
    if cfg.looped:
        inj = {"huginn_linear": 2 * d * d + (d if cfg.adapter_bias else 0), "deq_qkv": cfg.n_core * d * (d + 2 * kv),
               "parcae_decay": d * d + 3 * d}.get(cfg.injection, d * d + 2 * d)
        inj += d if cfg.input_norm else 0
        inj += d * d if cfg.state_readout else 0  # C, applied once per pass (counted with the injection)
    layers = cfg.physical_layers * layer
    return {"embedding": emb, "layers": layers, "injection": inj, "head": head + d,
            "non_embedding": layers + inj + d, "total": emb + layers + inj + head + d}


def size_line(cfg: ModelConfig, vocab_size: int) -> str:
    """One line for a run's log: parameter counts (:func:`param_count`) and the layer stack."""
    c = param_count(cfg, vocab_size)
    stack = (f"layers {cfg.n_prelude} prelude + {cfg.n_core} core x R + {cfg.n_coda} coda" if cfg.looped
             else f"{cfg.physical_layers} layers")
    return (f"model: {c['total']:,} parameters ({c['non_embedding']:,} non-embedding), {stack}, "
            f"d={cfg.hidden_size}, padded vocab {cfg.padded_vocab(vocab_size):,}")
