"""Hugging Face configuration of megaloop looped (recurrent-depth) language models.

Self-contained: imports only the standard library and ``transformers`` so that an exported
folder loads with ``trust_remote_code=True`` where megaloop is not installed.

Depth and cache behaviour are plain config fields, so they can be overridden at load time::

    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True,
                                         num_recurrences=8, kv_cache_mode="per_visit")
"""

from __future__ import annotations

try:  # transformers >= 5 (the old spelling remains there as an alias)
    from transformers import PreTrainedConfig
except ImportError:  # transformers 4.x
    from transformers import PretrainedConfig as PreTrainedConfig

INJECTIONS = ("huginn_linear", "parcae_decay", "parcae_nonorm", "orthoinj", "deq_qkv", "orthoinj_early")
ARCHS = ("looped", "untied")
STATE_INITS = ("normal", "zero")
KV_CACHE_MODES = ("terminal", "per_visit")


class MegaloopConfig(PreTrainedConfig):
    r"""Shapes, recipe and inference budgets of a megaloop model.

    Architecture (``arch="looped"``): embedding → ``n_prelude`` layers (output ``e``) → state
    init ``h⁰`` → ``r`` recurrences ``h ← exit(core(inject(h, e)))`` of a weight-shared
    ``n_core``-layer core → ``n_coda`` layers → final RMSNorm → head. ``arch="untied"`` is a
    plain ``num_hidden_layers``-layer transformer. Layers are pre-norm (RMSNorm) with rotary
    (rotate-half) attention, grouped queries and a SwiGLU MLP, all without biases.

    Args:
        vocab_size: rows of the embedding / head (the *padded* vocabulary of the training run).
        tokenizer_vocab_size: size of the tokenizer's vocabulary (ids above it are padding).
        hidden_size, num_attention_heads, num_key_value_heads, intermediate_size: widths.
        arch: ``looped`` or ``untied``.
        n_prelude, n_core, n_coda: physical layers of a looped model.
        num_hidden_layers: physical layers (``n_prelude + n_core + n_coda`` when looped).
        injection: one of ``huginn_linear``, ``parcae_decay``, ``parcae_nonorm``, ``orthoinj``,
            ``deq_qkv``.
        rms_norm_eps: eps of the learned RMSNorms (layer norms, final norm, Parcae input norm).
        exit_norm_eps: eps of the parameter-free core-exit RMSNorm (``huginn_linear``).
        exit_norm: whether ``huginn_linear`` applies that exit norm (false: the paper's diagnostic).
        ortho_eps: ε of the OrthoInj projection ``v − q(qᵀv)/(qᵀq + ε)``.
        rope_theta: rotary base.
        max_position_embeddings: training sequence length (informational; rotary extrapolates).
        state_init / state_init_std: training-time ``h⁰`` (``normal`` → N(0, std²), or ``zero``).
        eval_state_init / eval_seed: evaluation-time ``h⁰``: ``normal`` uses a per-position
            Gaussian fixed by ``eval_seed`` (row ``t`` drawn from a CPU generator seeded with
            ``eval_seed * 1_000_003 + t``, times ``state_init_std``, same for every batch row),
            ``zero`` uses zeros.
        num_recurrences: default depth ``R`` (used when no budget below applies).
        prefill_recurrences: depth of multi-token (prefill) forwards; ``None`` = ``num_recurrences``.
        decode_recurrences: depth of one-token forwards over a non-empty cache; ``None`` =
            ``num_recurrences``.
        kv_cache_mode: ``terminal`` (one KV bank per physical layer and token; core layers keep
            the token's terminal recurrence) or ``per_visit`` (``n_prelude + n_core·R + n_coda``
            banks per token).
        exit_criterion / min_depth / max_depth: adaptive per-token depth of one-token decode steps
            (``adaptive_megaloop.py``): ``"latent:1e-3"``, ``"kl:1e-4"`` or ``"argmax:3"`` (None =
            fixed depth); recurrences 2 ≤ ``min_depth`` ≤ depth ≤ ``max_depth`` (None = decode depth).
        tie_word_embeddings: head shares the embedding matrix.
        initializer_range / deq_std: init stds (used only for freshly constructed models).
    """

    model_type = "megaloop"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size: int = 256,
        tokenizer_vocab_size: int | None = None,
        hidden_size: int = 256,
        num_attention_heads: int = 4,
        num_key_value_heads: int | None = None,
        intermediate_size: int | None = None,
        arch: str = "looped",
        n_prelude: int = 1,
        n_core: int = 2,
        n_coda: int = 1,
        num_hidden_layers: int | None = None,
        injection: str = "parcae_nonorm",
        rms_norm_eps: float = 1e-5,
        exit_norm_eps: float = 1e-6,
        exit_norm: bool = True,
        ortho_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 256,
        state_init: str = "normal",
        state_init_std: float = 0.02,
        eval_state_init: str = "normal",
        eval_seed: int = 0,
        num_recurrences: int = 5,
        prefill_recurrences: int | None = None,
        decode_recurrences: int | None = None,
        kv_cache_mode: str = "terminal",
        exit_criterion: str | None = None,
        min_depth: int = 2,
        max_depth: int | None = None,
        initializer_range: float = 0.02,
        deq_std: float = 0.02,
        tie_word_embeddings: bool = False,
        embedding_multiplier: float = 1.0,
        qk_norm: bool = False,
        qk_norm_gain: bool = True,
        qk_bias: bool = False,
        adapter_init: str = "torch",
        adapter_bias: bool = True,
        input_norm: bool = False,
        sandwich_norm: bool = False,
        state_readout: bool = False,
        state_final_norm: bool = False,
        use_cache: bool = True,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        self.vocab_size = int(vocab_size)
        self.tokenizer_vocab_size = int(tokenizer_vocab_size) if tokenizer_vocab_size else self.vocab_size
        self.hidden_size = int(hidden_size)
        self.num_attention_heads = int(num_attention_heads)
        self.num_key_value_heads = int(num_key_value_heads or num_attention_heads)
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.intermediate_size = int(intermediate_size or -(-int(8 * hidden_size / 3) // 64) * 64)
        self.arch = arch
        self.n_prelude, self.n_core, self.n_coda = int(n_prelude), int(n_core), int(n_coda)
        if arch == "looped":
            num_hidden_layers = self.n_prelude + self.n_core + self.n_coda
        self.num_hidden_layers = int(num_hidden_layers if num_hidden_layers is not None else 4)
        self.injection = injection
        self.rms_norm_eps = float(rms_norm_eps)
        self.exit_norm_eps = float(exit_norm_eps)
        self.exit_norm = bool(exit_norm)
        self.ortho_eps = float(ortho_eps)
        self.rope_theta = float(rope_theta)
        self.max_position_embeddings = int(max_position_embeddings)
        self.state_init = state_init
        self.state_init_std = float(state_init_std)
        self.eval_state_init = eval_state_init
        self.eval_seed = int(eval_seed)
        self.num_recurrences = int(num_recurrences)
        self.prefill_recurrences = None if prefill_recurrences is None else int(prefill_recurrences)
        self.decode_recurrences = None if decode_recurrences is None else int(decode_recurrences)
        self.kv_cache_mode = kv_cache_mode
        self.exit_criterion = exit_criterion or None
        self.min_depth = int(min_depth)
        self.max_depth = None if max_depth is None else int(max_depth)
        self.initializer_range = float(initializer_range)
        self.deq_std = float(deq_std)
        self.embedding_multiplier = float(embedding_multiplier)  # on the embedding output (not on inputs_embeds)
        self.qk_norm = bool(qk_norm)  # RMSNorm on each head's q and k before RoPE
        self.qk_norm_gain = bool(qk_norm_gain)  # false: its gains stay at 1, untrained (Parcae's F.rms_norm)
        self.qk_bias = bool(qk_bias)  # learned per-head q and k biases before RoPE (Huginn's)
        self.adapter_init = adapter_init  # huginn_linear adapter's init: torch (default Linear) | normal
        self.adapter_bias = bool(adapter_bias)  # huginn_linear adapter has a bias
        self.input_norm = bool(input_norm)  # the injection reads RMSNorm_g(e)
        self.sandwich_norm = bool(sandwich_norm)  # RMSNorm of the residual stream after each residual add
        self.state_readout = bool(state_readout)  # learned readout C on the final state before the coda
        self.state_final_norm = bool(state_final_norm)  # the final norm (same weight) on h^R before C/the coda
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)
        self.validate()

    @property
    def looped(self) -> bool:
        return self.arch == "looped"

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""

        def need(cond: bool, field: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"MegaloopConfig.{field}: {msg}")

        need(self.arch in ARCHS, "arch", f"unknown arch {self.arch!r}; one of {ARCHS}")
        need(self.injection in INJECTIONS, "injection", f"unknown injection {self.injection!r}; one of {INJECTIONS}")
        need(self.hidden_size % self.num_attention_heads == 0, "num_attention_heads",
             f"hidden_size {self.hidden_size} is not divisible by {self.num_attention_heads} heads")
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
             f"{self.num_key_value_heads} must divide num_attention_heads {self.num_attention_heads}")
        need(self.state_init in STATE_INITS, "state_init", f"one of {STATE_INITS}")
        need(self.adapter_init in ("torch", "normal"), "adapter_init", f"torch or normal, got {self.adapter_init!r}")
        need(self.eval_state_init in STATE_INITS, "eval_state_init", f"one of {STATE_INITS}")
        need(self.kv_cache_mode in KV_CACHE_MODES, "kv_cache_mode",
             f"unknown mode {self.kv_cache_mode!r}; one of {KV_CACHE_MODES}")
        for f in ("num_recurrences", "prefill_recurrences", "decode_recurrences"):
            v = getattr(self, f)
            need(v is None or v >= 1, f, f"must be >= 1, got {v}")
        need(self.exit_criterion is None or ":" in str(self.exit_criterion), "exit_criterion",
             f"expected NAME:VALUE (e.g. latent:1e-3), got {self.exit_criterion!r}")
        need(self.min_depth >= 2, "min_depth", f"must be >= 2, got {self.min_depth}")
        need(self.max_depth is None or self.max_depth >= self.min_depth, "max_depth",
             f"must be >= min_depth {self.min_depth}, got {self.max_depth}")
        if self.looped:
            need(self.n_core >= 1, "n_core", "a looped model needs n_core >= 1")
            need(self.n_prelude >= 0 and self.n_coda >= 0, "n_prelude", "layer counts must be >= 0")
        else:
            need(self.num_hidden_layers >= 1, "num_hidden_layers", "must be >= 1")
        need(self.tokenizer_vocab_size <= self.vocab_size, "tokenizer_vocab_size",
             f"{self.tokenizer_vocab_size} exceeds vocab_size {self.vocab_size}")

    @property
    def prefill_depth(self) -> int:
        return self.prefill_recurrences or self.num_recurrences

    @property
    def decode_depth(self) -> int:
        return self.decode_recurrences or self.num_recurrences


__all__ = ["MegaloopConfig"]
