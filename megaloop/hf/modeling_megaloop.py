"""Pure-PyTorch Hugging Face implementation of megaloop's LoopedGPT (``trust_remote_code``).

Imports only torch, transformers and the standard library (never megaloop or megatron), so an
exported folder runs where megaloop is not installed. Numerically it follows the native
megatron-core model exactly (same ops in the same dtypes):

* layers: pre-norm RMSNorm → grouped-query attention with rotary embeddings (rotate-half,
  ``rope_theta``) and softmax scale ``1/√head_dim`` → residual; RMSNorm → SwiGLU MLP
  (``down(silu(gate(x)) · up(x))``) → residual; no biases. megatron's fused QKV weight
  ``[groups, (heads/groups + 2)·head_dim, d]`` is stored split as ``q_proj``/``k_proj``/``v_proj``
  (query heads ordered group by group), its ``[gate; up]`` fc1 as ``gate_proj``/``up_proj``.
* looped forward: ``e = prelude(embed(x))``; ``h⁰ = init(e)``; ``h ← exit(core(inject(h, e)))``
  ``R`` times; ``logits = head(norm(coda(h)))``. Injections: ``huginn_linear`` (``W[h; e; 1]``,
  parameter-free FP32 core-exit RMSNorm, eps 1e-6), ``parcae_decay`` / ``parcae_nonorm`` /
  ``orthoinj`` (``Λ⊙h + Δ⊙(W ẽ)``, OrthoInj projects the carry orthogonally to ``q`` in FP32,
  ε 1e-6), ``deq_qkv`` (``W^e e`` added to Q/K/V in every core layer).
* eval-mode ``h⁰`` (``eval_state_init="normal"``): row for absolute position ``t`` is
  ``randn(d, generator=Generator().manual_seed(eval_seed·1_000_003 + t)) · state_init_std``,
  the same for every batch row — identical to the native eval mode. Train mode draws fresh
  ``N(0, std²)`` noise (``state_init``); this export is meant for inference.

KV caching (:class:`MegaloopCache`): a forward over ``s`` new tokens with ``L`` cached ones is
the training-style parallel pass over the new tokens (recurrence ``r`` of a new token reads the
new tokens' depth-``r`` KV, causally, plus the cached prefix banks); afterwards the cache keeps

* ``terminal`` mode: one bank per physical attention layer per token — prelude/coda KV and, for
  each core layer, the KV of the token's *terminal* (last) recurrence; every recurrence of a later
  token attends to those terminal banks;
* ``per_visit`` mode: ``n_prelude + n_core·R + n_coda`` banks per token (core layer ℓ at
  recurrence ``r`` has its own bank, read by recurrence ``r`` of later tokens). If later tokens
  run deeper than the cached ones, recurrence ``r`` reads each cached token's visit
  ``min(r, R_token − 1)``. Token-by-token per-visit decoding equals the plain parallel forward.

Recurrence API (:class:`LoopedPass`, from ``model.begin(input_ids)``): ``init_state``, ``step(h, r)``
(one recurrence), ``readout(h)`` (coda → norm → head), ``rows(idx)``. The forward, adaptive decoding,
megaloop's fixed-point solver, RL gradient estimators and distilled prefill all walk the model
through it; nothing else touches the prelude / core / injection / coda modules.

Adaptive per-token depth (``exit_criterion="latent:1e-3"``, ``min_depth``, ``max_depth`` as forward /
``generate`` kwargs or config fields): one-token steps over a filled cache stop each row's recurrence
when its state settles (``adaptive_megaloop.py``); ``cache.exit_depths`` logs the per-row depths.
Injections live in ``injection_megaloop.py``, the layers in ``layers_megaloop.py``.

Depth of a forward: ``num_recurrences`` when passed; else a one-token forward over a non-empty
cache uses ``decode_recurrences`` and any other forward ``prefill_recurrences`` (both default to
``config.num_recurrences``). Without a cache (``use_cache=False``) a forward is the native
parallel forward at that depth. Runs under transformers 4.57 and 5.x (APIs detected by feature).
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from typing import Callable, Mapping, Optional, Union

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .adaptive_megaloop import ExitPolicy, adaptive_decode
from .cache_megaloop import MegaloopCache, one_cache
from .configuration_megaloop import MegaloopConfig
from .injection_megaloop import DiagonalInjection, HuginnInjection, build_injection
from .layers_megaloop import (MegaloopAttention, MegaloopEmbedding, MegaloopLayer, MegaloopRMSNorm,
                              VocabResizeMixin, causal_lm_loss, rotary_cos_sin)

KV = tuple[torch.Tensor, torch.Tensor]
BankReader = Callable[[str, int, int], Optional[KV]]  # (group, layer index, recurrence) -> cached (k, v)
EVAL_NOISE_STRIDE = 1_000_003
# transformers APIs that differ (4.57 … 5.x), detected by feature: recent 5.x name the outputs' cache field
# ``cache`` (``past_key_values`` warns); 5.x generate() passes ``next_sequence_length``, 4.x ``cache_position``.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
GENERATE_V5 = "next_sequence_length" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters


# ----------------------------------------------------------------------------- helpers
def eval_noise(seed: int, start: int, stop: int, dim: int) -> torch.Tensor:
    """Eval-time state-init rows for absolute positions ``start..stop-1`` ([n, dim], FP32, CPU):
    row ``t`` ~ N(0, 1) drawn from a CPU generator seeded with ``seed * 1_000_003 + t``."""
    rows = [torch.randn(dim, generator=torch.Generator().manual_seed(seed * EVAL_NOISE_STRIDE + t))
            for t in range(start, stop)]
    return torch.stack(rows) if rows else torch.zeros(0, dim)


# ----------------------------------------------------------------------------- recurrence API
def _take_rows(t, idx: torch.Tensor, b: int):
    """Rows ``idx`` of batch-first tensors (tuples recursed; broadcast tensors kept)."""
    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(_take_rows(x, idx, b) for x in t)
    return t.index_select(0, idx) if t.dim() >= 2 and t.shape[0] == b else t


class LoopedPass:
    """The recurrence of a looped :class:`MegaloopModel`, one piece at a time — the single way
    code outside this file walks the model (HF forward, adaptive decoding, fixed-point solver,
    RL gradient estimators, distilled prefill)::

        p = lm.begin(input_ids)          # embedding + prelude over the new tokens: p.e [b, s, d]
        h = p.init_state()               # h⁰ [b, s, d] (eval: per-position Gaussian; train: noise)
        h, kv = p.step(h, r)             # recurrence r: exit(core(inject(h, e))); kv: one (k, v) per core layer
        logits, kv = p.readout(h)        # coda → final norm → head: [b, s, V]; kv: one per coda layer

    Attention reads earlier tokens through ``read(group, layer, recurrence)`` (a
    :class:`MegaloopCache`, a dict of frozen banks ``{(group, layer): (k, v)}`` or nothing); the
    new tokens attend to each other causally at the same recurrence, as in training. The new
    K/V are returned, never stored: the caller decides what a cache keeps.
    """

    def __init__(self, model: "MegaloopModel", x: torch.Tensor, positions: torch.Tensor,
                 mask: Optional[torch.Tensor], read: Optional[BankReader], head: Optional[nn.Module] = None,
                 e: Optional[torch.Tensor] = None):
        cfg = model.config
        self.model, self.config, self.head = model, cfg, head
        self.positions, self.mask = positions, mask
        self.read: BankReader = read or (lambda group, index, recurrence: None)
        self.rope = rotary_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        self.prelude_kv: list[KV] = []
        if e is None:
            for i, layer in enumerate(model.prelude):
                x, kv = layer(x, self.rope, mask, self.read("prelude", i, 0))
                self.prelude_kv.append(kv)
            e = x
        self.e = e
        self.e_qkv = e if model.injection.uses_qkv_injection else None
        self._ctx = None

    @property
    def batch_size(self) -> int:
        return self.e.shape[0]

    @property
    def ctx(self):
        """``injection.prepare(e)``, built once, with autograd whenever ``e`` carries a graph (a
        first step under ``no_grad`` — TBPTT's skipped recurrences — must not leave it graph-less)."""
        if self._ctx is None:
            with torch.enable_grad() if self.e.requires_grad else nullcontext():
                self._ctx = self.model.injection.prepare(self.e)
        return self._ctx

    def init_state(self, zero: bool = False) -> torch.Tensor:
        """``h⁰`` [b, s, d] in the model's mode (``zero=True``: zeros)."""
        return torch.zeros_like(self.e) if zero else self.model.init_state(self.e, self.positions)

    def inject(self, h: torch.Tensor) -> torch.Tensor:
        """The core's input ``inject(h, e)`` [b, s, d] (DEQ-QKV: ``h``; ``e`` enters Q/K/V)."""
        return self.model.injection(h, self.ctx)

    def step(self, h: torch.Tensor, r: int = 0, block=None) -> tuple[torch.Tensor, list[KV]]:
        """Recurrence ``r`` (0-based; selects the per-visit cached banks): ``exit(core(inject(h, e)))``.
        ``block`` (an object with ``injection`` and ``layers``, e.g. a prefill student) replaces the
        model's own injection and core layers."""
        inj, layers = (self.model.injection, self.model.core) if block is None else (block.injection, block.layers)
        ctx = self.ctx if block is None else inj.prepare(self.e)
        z, kvs = inj(h, ctx), []
        for i, layer in enumerate(layers):
            z, kv = layer(z, self.rope, self.mask, self.read("core", i, r), self.e_qkv)
            kvs.append(kv)
        return inj.exit(z), kvs

    def coda(self, h: torch.Tensor) -> tuple[torch.Tensor, list[KV]]:
        """Final norm on the state (``state_final_norm``), readout C (``state_readout``) and the
        coda layers over the state (before the final norm), and the coda's K/V."""
        h = self.model.norm(h) if getattr(self.config, "state_final_norm", False) else h  # shared weight
        if self.model.state_readout is not None:
            h = self.model.state_readout(h)
        kvs = []
        for i, layer in enumerate(self.model.coda):
            h, kv = layer(h, self.rope, self.mask, self.read("coda", i, 0))
            kvs.append(kv)
        return h, kvs

    def readout(self, h: torch.Tensor, keep: int = 0) -> tuple[torch.Tensor, list[KV]]:
        """Logits [b, s | keep, V] of state ``h`` (coda → final norm → head) and the coda K/V."""
        if self.head is None:
            raise ValueError("readout needs the head: begin the pass on MegaloopForCausalLM")
        x, kvs = self.coda(h)
        x = self.model.norm(x)
        return self.head(x[:, -keep:] if keep else x), kvs

    def rows(self, idx: torch.Tensor) -> "LoopedPass":
        """This pass restricted to batch rows ``idx`` (cached banks gathered on first read)."""
        b, sub = self.batch_size, object.__new__(LoopedPass)
        sub.__dict__.update(self.__dict__)
        sub.positions, sub.mask = _take_rows(self.positions, idx, b), _take_rows(self.mask, idx, b)
        sub.rope, sub.e, sub.e_qkv = _take_rows(self.rope, idx, b), self.e[idx], _take_rows(self.e_qkv, idx, b)
        sub._ctx = _take_rows(self.ctx, idx, b)
        sub.prelude_kv = [_take_rows(kv, idx, b) for kv in self.prelude_kv]
        gathered: dict = {}
        base = self.read

        def read(group: str, index: int, recurrence: int) -> Optional[KV]:
            kv = base(group, index, recurrence)
            if kv is None:
                return None
            key = (group, index, kv[0].data_ptr(), tuple(kv[0].shape))
            if key not in gathered:
                gathered[key] = _take_rows(kv, idx, b)
            return gathered[key]

        sub.read = read
        return sub


# ----------------------------------------------------------------------------- models
class MegaloopPreTrainedModel(VocabResizeMixin, PreTrainedModel):
    config_class = MegaloopConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["MegaloopLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]

    def _init_weights(self, module: nn.Module) -> None:
        # torch.nn.init on the parameters themselves (never ``.data``): transformers 5.x guards these
        # functions so that weights already loaded from a checkpoint are not re-initialized.
        std = self.config.initializer_range
        if isinstance(module, HuginnInjection):
            if getattr(self.config, "adapter_init", "torch") == "normal":
                nn.init.normal_(module.adapter.weight, 0.0, std)
                if module.adapter.bias is not None:
                    nn.init.zeros_(module.adapter.bias)
            else:
                module.adapter.reset_parameters()  # torch's default Linear init (as the native model)
            if module.in_norm_weight is not None:
                nn.init.ones_(module.in_norm_weight)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)
        elif isinstance(module, MegaloopRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, DiagonalInjection):
            module.reset_parameters()
        elif isinstance(module, MegaloopAttention):
            if module.inject:
                for lin in (module.q_inject, module.k_inject, module.v_inject):
                    nn.init.normal_(lin.weight, 0.0, self.config.deq_std)
            if module.qk_bias:
                nn.init.zeros_(module.q_bias)
                nn.init.zeros_(module.k_bias)


class MegaloopModel(MegaloopPreTrainedModel):
    """Embedding → prelude → R recurrences of the core → coda → final norm (no head)."""

    def __init__(self, config: MegaloopConfig):
        super().__init__(config)
        config.validate()
        self.embed_tokens = MegaloopEmbedding(config)
        if config.looped:
            self.prelude = nn.ModuleList([MegaloopLayer(config) for _ in range(config.n_prelude)])
            deq = config.injection == "deq_qkv"
            self.core = nn.ModuleList([MegaloopLayer(config, inject=deq) for _ in range(config.n_core)])
            self.injection = build_injection(config)
            self.coda = nn.ModuleList([MegaloopLayer(config) for _ in range(config.n_coda)])
            self.state_readout = (nn.Linear(config.hidden_size, config.hidden_size, bias=False)
                                  if getattr(config, "state_readout", False) else None)
        else:
            self.state_readout = None
            self.layers = nn.ModuleList([MegaloopLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = MegaloopRMSNorm(config.hidden_size, config.rms_norm_eps)
        self._noise_table: Optional[torch.Tensor] = None  # memo of eval_noise rows (CPU or device)
        self._noise_key: Optional[tuple[int, int]] = None
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    # ------------------------------------------------------------ pieces
    def depth_for(self, num_new: int, past_len: int, num_recurrences: Optional[int] = None) -> int:
        """Recurrence budget of a forward over ``num_new`` tokens after ``past_len`` cached ones."""
        if num_recurrences is not None:
            depth = int(num_recurrences)
        elif num_new == 1 and past_len > 0:
            depth = self.config.decode_recurrences or self.config.num_recurrences
        else:
            depth = self.config.prefill_recurrences or self.config.num_recurrences
        if depth < 1:
            raise ValueError(f"num_recurrences must be >= 1, got {depth}")
        return depth

    def eval_noise_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Eval-time N(0,1) rows for integer ``positions`` (any shape) → [..., d], FP32."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        key = (self.config.eval_seed, self.config.hidden_size)
        table = self._noise_table if self._noise_key == key else None
        self._noise_key = key
        have = 0 if table is None else table.shape[0]
        if need > have:
            more = eval_noise(self.config.eval_seed, have, need, self.config.hidden_size)
            table = more if table is None else torch.cat([table.cpu(), more])
        if table is None:
            table = torch.zeros(0, self.config.hidden_size)
        if table.device != positions.device:
            table = table.to(positions.device)
        self._noise_table = table
        return table[positions]

    def init_state(self, e: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """h⁰ for prelude output e [b, s, d] at absolute ``positions`` [b, s]."""
        cfg = self.config
        mode = cfg.state_init if self.training else cfg.eval_state_init
        if mode == "zero":
            return torch.zeros_like(e)
        if self.training:
            return (torch.randn(e.shape, device=e.device, dtype=torch.float32) * cfg.state_init_std).to(e.dtype)
        return (self.eval_noise_rows(positions) * cfg.state_init_std).to(e.dtype)

    def frame(self, positions: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor], b: int, s: int,
              past: int, device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Positions [b, s] of ``s`` new tokens after ``past`` cached ones (default: counted over the
        unpadded tokens of ``attention_mask``, as generate does, else ``past..past+s-1``; a 1-D
        ``positions`` is shared by every row) and their attention mask (:meth:`attention_mask_for`)."""
        padded = attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] == past + s
        if positions is None and padded and not bool(attention_mask.all()):  # h⁰ and RoPE follow real positions
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:].to(device)
        elif positions is None:
            positions = torch.arange(past, past + s, device=device)[None].expand(b, s)
        elif positions.dim() == 1:
            positions = positions[None].expand(b, s)
        return positions, self.attention_mask_for(attention_mask, b, s, past, device)

    @staticmethod
    def attention_mask_for(attention_mask: Optional[torch.Tensor], b: int, s: int, past: int,
                           device: torch.device) -> Optional[torch.Tensor]:
        """Boolean [b|1, 1, s, past+s] mask (True = attend), or None for plain causal attention.
        ``attention_mask`` [b, past+s] marks padding with 0; a query always sees itself."""
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[1] != past + s:
                raise ValueError(f"attention_mask must have shape [batch, {past + s}] (cached + new "
                                 f"tokens), got {tuple(attention_mask.shape)}")
            if bool(attention_mask.all()):
                attention_mask = None
        if attention_mask is None and past == 0:
            return None
        allowed = torch.ones(s, past + s, dtype=torch.bool, device=device)
        allowed[:, past:] = torch.ones(s, s, dtype=torch.bool, device=device).tril()
        allowed = allowed[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
            diag = torch.zeros(s, past + s, dtype=torch.bool, device=device)
            diag[torch.arange(s), past + torch.arange(s)] = True
            allowed = allowed | diag[None, None]
        return allowed

    def begin(self, input_ids: Optional[torch.Tensor] = None, *, e: Optional[torch.Tensor] = None,
              positions: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
              past: Union[MegaloopCache, Mapping, None] = None, head: Optional[nn.Module] = None) -> LoopedPass:
        """A :class:`LoopedPass` over new tokens ``input_ids`` [b, s] (or a given prelude output
        ``e`` [b, s, d], skipping embedding and prelude). ``positions`` [b, s] default to the
        tokens after the ``past`` ones; ``attention_mask`` [b, past + s] marks padding with 0;
        ``past`` is a :class:`MegaloopCache` (read, never written) or frozen banks
        ``{(group, layer): (k, v)}`` of earlier tokens."""
        if not self.config.looped:
            raise ValueError("the recurrence API needs a looped model (arch='looped'), got an untied one")
        if (input_ids is None) == (e is None):
            raise ValueError("pass exactly one of input_ids or e")
        if isinstance(past, Mapping):
            banks = past
            past_len = next(iter(banks.values()))[0].shape[2] if banks else 0
            read = (lambda group, index, recurrence: banks.get((group, index))) if banks else None
        else:
            past_len = past.get_seq_length() if past is not None else 0
            read = past.read if past is not None else None
        ref = e if e is not None else input_ids
        b, s = ref.shape[0], ref.shape[1]
        positions, mask = self.frame(positions, attention_mask, b, s, past_len, ref.device)
        x = self.embed_tokens(input_ids) if e is None else e
        return LoopedPass(self, x, positions, mask, read, head, e=e)

    def recurrent_block(self) -> tuple[nn.Module, nn.ModuleList]:
        """The injection and core layers of one recurrence (e.g. to copy into a prefill student)."""
        return self.injection, self.core

    # ------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[MegaloopCache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        num_recurrences: Optional[int] = None,
        cache: Optional[MegaloopCache] = None,
        **kwargs,
    ) -> Union[tuple, BaseModelOutputWithPast]:
        cfg = self.config
        use_cache = cfg.use_cache if use_cache is None else use_cache
        output_hidden_states = output_hidden_states if output_hidden_states is not None else cfg.output_hidden_states
        return_dict = return_dict if return_dict is not None else getattr(cfg, "return_dict", True)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, s, _ = x.shape
        cache = one_cache(past_key_values, cache)
        if cache is not None and not (hasattr(cache, "read") and hasattr(cache, "commit")):  # not a MegaloopCache
            if hasattr(cache, "get_seq_length") and cache.get_seq_length() == 0:
                cache = None  # an empty generic HF cache: replace it with ours
            else:
                raise TypeError("past_key_values must be a MegaloopCache (model.new_cache()), "
                                f"got {type(cache).__name__}")
        if cache is None and use_cache:
            cache = MegaloopCache(cfg)
        past = cache.get_seq_length() if cache is not None else 0
        if cache is not None and past and cache.batch_size not in (None, b):
            raise ValueError(f"cache holds {cache.batch_size} sequences, input has {b}")
        depth = self.depth_for(s, past, num_recurrences)
        position_ids, mask = self.frame(position_ids, attention_mask, b, s, past, x.device)
        keep_all = cache is not None and cache.mode == "per_visit"
        new: dict = {}
        states = [x] if output_hidden_states else None
        if cfg.looped:
            p = LoopedPass(self, x, position_ids, mask, cache.read if cache is not None else None)
            new.update({("prelude", i, 0): kv for i, kv in enumerate(p.prelude_kv)})
            if states is not None:
                states.append(p.e)
            h = p.init_state()
            for r in range(depth):
                h, kvs = p.step(h, r)
                if keep_all or r == depth - 1:
                    new.update({("core", i, r): kv for i, kv in enumerate(kvs)})
                if states is not None:
                    states.append(h)
            x, kvs = p.coda(h)
            new.update({("coda", i, 0): kv for i, kv in enumerate(kvs)})
        else:
            rope = rotary_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, x.dtype)
            for i, layer in enumerate(self.layers):
                x, new[("layers", i, 0)] = layer(x, rope, mask, cache.read("layers", i) if cache is not None else None)
        if cache is not None:
            if cache.batch_size is None:
                cache.batch_size = b
            cache.commit(new, depth, s)
        if states is not None:
            states.append(x)
        x = self.norm(x)
        if not return_dict:
            return tuple(t for t in (x, cache, tuple(states) if states else None) if t is not None)
        return BaseModelOutputWithPast(last_hidden_state=x, hidden_states=tuple(states) if states else None,
                                       **{CACHE_FIELD: cache})


class MegaloopForCausalLM(MegaloopPreTrainedModel, GenerationMixin):
    """Looped LM with a (tied or untied) head over the padded vocabulary.

    ``hidden_states`` (``output_hidden_states=True``): embedding, prelude output ``e``, the state
    after each recurrence ``h¹..h^R``, coda output (before the final norm); untied: embedding and
    the last layer's output.
    """

    # a dict (target -> source) for transformers 5; 4.x iterates it like the old list of targets
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MegaloopConfig):
        super().__init__(config)
        self.model = MegaloopModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model creates its own MegaloopCache

    # ------------------------------------------------------------ inference helpers
    def new_cache(self, mode: Optional[str] = None) -> MegaloopCache:
        """An empty cache (``terminal`` / ``per_visit``; default ``config.kv_cache_mode``)."""
        return MegaloopCache(self.config, mode)

    def kv_bytes_per_token(self, mode: Optional[str] = None, num_recurrences: Optional[int] = None,
                           dtype: Optional[torch.dtype] = None) -> int:
        """KV-cache bytes per token of one sequence: banks × 2 (K, V) × kv_heads × head_dim × bytes.
        Banks: ``n_prelude + n_core + n_coda`` (terminal) or ``n_prelude + n_core·R + n_coda``
        (per_visit, R = ``num_recurrences`` or the decode budget)."""
        cfg = self.config
        mode = mode or cfg.kv_cache_mode
        if cfg.looped:
            r = num_recurrences or cfg.decode_recurrences or cfg.num_recurrences
            banks = cfg.n_prelude + cfg.n_coda + cfg.n_core * (r if mode == "per_visit" else 1)
        else:
            banks = cfg.num_hidden_layers
        elsize = torch.empty((), dtype=dtype or self.dtype).element_size()
        return banks * 2 * cfg.num_key_value_heads * cfg.head_dim * elsize

    def begin(self, input_ids: Optional[torch.Tensor] = None, **kwargs) -> LoopedPass:
        """:meth:`MegaloopModel.begin` with this model's head, so the pass has a ``readout``."""
        return self.model.begin(input_ids, head=self.lm_head, **kwargs)

    def exit_policy(self, exit_criterion=None, min_depth=None, max_depth=None) -> Optional[ExitPolicy]:
        """Adaptive-depth policy of these arguments, else of the config (:meth:`ExitPolicy.of_config`)."""
        return ExitPolicy.of_config(self.config, exit_criterion, min_depth, max_depth)

    # ------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[MegaloopCache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        num_recurrences: Optional[int] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        cache: Optional[MegaloopCache] = None,
        token_type_ids: Optional[torch.Tensor] = None,
        exit_criterion: Optional[str] = None,
        min_depth: Optional[int] = None,
        max_depth: Optional[int] = None,
        **kwargs,
    ) -> Union[tuple, CausalLMOutputWithPast]:
        """Logits [b, s, vocab_size]; ``labels`` (HF convention, shifted inside, -100 ignored) add
        the mean CE, or with ``num_items_in_batch`` (HF Trainer's gradient accumulation) the CE sum over
        it. ``num_recurrences`` overrides the depth budget of this call. The cache may be
        passed as ``past_key_values`` or ``cache``; ``token_type_ids`` (from tokenizers) are ignored.
        ``exit_criterion`` (or the config's): one-token steps over a filled cache run adaptive depth."""
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        past_key_values = one_cache(past_key_values, cache)
        policy = self.exit_policy(exit_criterion, min_depth, max_depth)
        if (policy is not None and hasattr(past_key_values, "commit") and input_ids is not None
                and input_ids.shape[1] == 1 and past_key_values.get_seq_length() > 0):
            logits, depths, _ = adaptive_decode(self, input_ids, past_key_values, policy, attention_mask, position_ids)
            past_key_values.exit_depths.append(depths.cpu())  # the per-row depths of each adaptive step
            return CausalLMOutputWithPast(logits=logits, **{CACHE_FIELD: past_key_values})
        if labels is not None and use_cache is None and past_key_values is None:
            use_cache = False  # a scoring/training forward needs no cache
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_hidden_states=output_hidden_states, return_dict=True,
                         num_recurrences=num_recurrences)
        past_key_values = getattr(out, CACHE_FIELD)
        h = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            h = h[:, -logits_to_keep:] if logits_to_keep else h
        else:
            h = h[:, logits_to_keep]
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels, kwargs.get("num_items_in_batch"))
        if not return_dict:
            rest = tuple(t for t in (logits, past_key_values, out.hidden_states) if t is not None)
            return ((loss,) + rest) if loss is not None else rest
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                      **{CACHE_FIELD: past_key_values})

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      inputs_embeds=None, use_cache=True, cache=None, next_sequence_length=None,
                                      is_first_iteration=None, cache_position=None, **kwargs):
        """Inputs of one generate() step for transformers 4.x (``past_key_values``, ``cache_position``)
        and 5.x (``cache`` or ``past_key_values``, ``next_sequence_length``, ``is_first_iteration``)."""
        past_key_values = one_cache(past_key_values, cache)
        if not use_cache and self.exit_policy(*(kwargs.get(k) for k in ("exit_criterion", "min_depth", "max_depth"))):
            raise ValueError("exit_criterion: adaptive depth runs in cached one-token decode steps; generate("
                             "use_cache=False) ran every step at full depth instead: drop use_cache=False or the criterion")
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if GENERATE_V5:  # tokens to run: the new ones (None = all the given ones)
            n = next_sequence_length
            use_embeds = inputs_embeds is not None and bool(is_first_iteration)
        else:
            n = cache_position.shape[0] if cache_position is not None else (input_ids.shape[1] - past or None)
            use_embeds = inputs_embeds is not None and past == 0
        keep = slice(-n, None) if n else slice(None)
        inputs_embeds, input_ids = (inputs_embeds[:, keep], None) if use_embeds else (None, input_ids[:, keep])
        position_ids = kwargs.get("position_ids")  # None: MegaloopModel.frame counts them over the mask
        if position_ids is not None:
            position_ids = position_ids[:, -(input_ids if inputs_embeds is None else inputs_embeds).shape[1]:]
        inputs = {"input_ids": input_ids, "inputs_embeds": inputs_embeds,
                  "past_key_values": past_key_values, "attention_mask": attention_mask,
                  "position_ids": position_ids, "use_cache": use_cache}
        extra = ("num_recurrences", "logits_to_keep", "output_hidden_states", "exit_criterion", "min_depth",
                 "max_depth")
        inputs.update({k: v for k, v in kwargs.items() if k in extra})
        return inputs  # (beam search reorders the cache through MegaloopCache.reorder_cache)


__all__ = ["LoopedPass", "MegaloopCache", "MegaloopForCausalLM", "MegaloopModel", "MegaloopPreTrainedModel", "eval_noise"]
