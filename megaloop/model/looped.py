"""LoopedGPT: prelude → weight-shared core applied r times with input injection → coda.

Shapes: token ids [b, s]; hidden states [s, b, d] (sequence-first, megatron convention; under
sequence parallelism each TP rank holds s/tp positions). Vocab-parallel embedding, head and CE.

Pipeline parallelism (SPEC/DESIGN): the layer graph of a looped model is cyclic, so instead of
splitting layers we split *recurrences*. With S = pp·vpp virtual stages, stage 0 holds the
embedding and prelude, stage S−1 the coda, final norm and head, and every stage holds a replica
of the core (and injection). A microbatch of depth r runs recurrences ``split_recurrences(r, ...)[v]``
on stage v (balanced by cost: megaloop.model.pipeline_split); stages exchange the packed tensor
``cat([h, e], dim=0)`` of shape [2s, b, d], so megatron's linear schedules run unchanged with
``seq_length = 2s``. Core replicas start equal (seeded by name) and stay equal because their
gradients are summed over the pipeline group before the data-parallel reduction (see
megaloop.train.grads).

Truncated BPTT (SPEC §3): recurrences ``i < r − b`` run under ``no_grad``; the state is detached
at ``i = r − b``; ``e`` keeps its graph, so the prelude still gets gradients through every
backpropagated injection.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import lru_cache
from itertools import count

import torch
from megatron.core import parallel_state, tensor_parallel
from torch.utils.checkpoint import checkpoint
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megaloop.model.config import ModelConfig
from megaloop.model.injection import build_injection
from megaloop.model.pipeline_split import split_costs, split_recurrences
from megaloop.model.specs import RMSNorm, layer_spec, use_transformer_engine
from megaloop.runtime.cpu_compat import without_redirect
from megaloop.runtime.parallel import stable_seed

try:  # TE's FP8 autocast around transformer layers; a null context without TE
    from megatron.core.fp8_utils import get_fp8_context
except ImportError:  # pragma: no cover
    def get_fp8_context(config, layer_no=-1, is_init=False):  # type: ignore[no-redef]
        return nullcontext()


@lru_cache(maxsize=16)
def eval_noise(seed: int, start: int, stop: int, dim: int) -> torch.Tensor:
    """Evaluation-time state init for positions start..stop-1: row t ~ N(0, 1)^dim drawn from a
    CPU generator seeded with ``seed * 1_000_003 + t``. Depends only on the position (not on the
    batch, sequence length or layout), so incremental decoding and the HF export reproduce it.
    Cached (one generator per position is slow at s=2048); callers must not modify the result."""
    rows = [torch.randn(dim, generator=torch.Generator().manual_seed(seed * 1_000_003 + t))
            for t in range(start, stop)]
    return torch.stack(rows) if rows else torch.zeros(0, dim)


class LayerStack(MegatronModule):
    """Physical transformer layers with globally unique ``layer_number`` s (1-based)."""

    def __init__(self, config: TransformerConfig, spec, numbers: list[int], vp_stage: int | None,
                 seed: int, name: str, first_index: int = 0, recompute: bool = False):
        super().__init__(config=config)
        self.recompute = recompute
        offset = get_transformer_layer_offset(
            config, vp_stage, parallel_state.get_pipeline_model_parallel_rank())
        for i, number in enumerate(numbers):
            # named and seeded by the index within the whole component (not within this pipeline
            # stage), so names, checkpoint keys and initial weights do not depend on the layout
            index = number - numbers[0] + first_index
            torch.manual_seed(stable_seed(seed, name, index))
            layer = build_module(spec, config=config, layer_number=number - offset, vp_stage=vp_stage)
            assert layer.layer_number == number
            self.add_module(str(index), layer)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None,
                inject: torch.Tensor | None = None) -> torch.Tensor:
        """[s, b, d] -> [s, b, d]; ``inject`` = e for DEQ-QKV layers. With ``recompute`` (model.recompute),
        each layer's activations are recomputed in backward instead of kept (torch non-reentrant
        checkpointing; RNG state restored; the injection is an input, so it is there again)."""
        recompute = self.recompute and self.training and torch.is_grad_enabled()
        for layer in self:
            if recompute:
                x = checkpoint(self._layer, layer, x, rope, mask, inject, use_reentrant=False)
            else:
                x = self._layer(layer, x, rope, mask, inject)
        return x

    def _layer(self, layer, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None,
               inject: torch.Tensor | None) -> torch.Tensor:
        if inject is not None:
            layer.self_attention.set_injection(inject)
        try:
            with get_fp8_context(self.config, layer.layer_number - 1):
                return layer(hidden_states=x, attention_mask=mask, rotary_pos_emb=rope)[0]
        finally:
            if inject is not None:
                layer.self_attention.set_injection(None)


class LoopedGPT(LanguageModule):
    """Looped (or, with ``arch=untied``, plain) GPT on megatron-core layers.

    ``forward(input_ids [b,s], labels [b,s] | None, depth=r, bptt_window=b, noise_seed=int)`` returns
    per-token CE [b, s] when labels are given on the last stage, logits [b, s, V/tp] without
    labels, and the packed stage output [2s(/tp), b, d] on other pipeline stages.
    """

    def __init__(self, cfg: ModelConfig, config: TransformerConfig, vocab_size: int, *,
                 pre_process: bool = True, post_process: bool = True,
                 vp_stage: int | None = None, seed: int = 1234):
        super().__init__(config=config)
        self.cfg = cfg
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process, self.post_process = pre_process, post_process
        self.vp_stage = vp_stage
        self.vocab_size = cfg.padded_vocab(vocab_size)
        self.share_embeddings_and_output_weights = cfg.tie_embeddings
        self.seed = seed
        self._input_tensor: torch.Tensor | None = None
        self._te = use_transformer_engine(cfg)
        self._mask_cache: dict = {}
        self._noise_counter = count()
        pp = config.pipeline_model_parallel_size
        vpp = config.virtual_pipeline_model_parallel_size or 1
        self.num_stages = pp * vpp
        self.split_costs = split_costs(cfg, self.vocab_size) if cfg.looped else None
        self.stage = (vp_stage or 0) * pp + parallel_state.get_pipeline_model_parallel_rank()
        head_dim = cfg.hidden_size // cfg.num_heads

        self.rotary = RotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0,
                                      rotary_base=cfg.rope_base, use_cpu_initialization=True)
        if pre_process:
            torch.manual_seed(stable_seed(seed, "embedding"))
            self.embedding = LanguageModelEmbedding(
                config=config, vocab_size=self.vocab_size, max_sequence_length=cfg.seq_len,
                position_embedding_type="rope")
        spec = layer_spec(cfg)
        if cfg.looped:
            if pre_process and cfg.n_prelude:
                self.prelude = LayerStack(config, spec, list(range(1, cfg.n_prelude + 1)),
                                          vp_stage, seed, "prelude", recompute=cfg.recompute)
            first_core = cfg.n_prelude + 1
            inject_spec = layer_spec(cfg, deq_inject=cfg.injection == "deq_qkv")
            self.core = LayerStack(config, inject_spec, list(range(first_core, first_core + cfg.n_core)),
                                   vp_stage, seed, "core", recompute=cfg.recompute)
            torch.manual_seed(stable_seed(seed, "injection"))
            self.injection = build_injection(cfg.injection, config, exit_norm=cfg.exit_norm,
                                             input_norm=cfg.input_norm, adapter_init=cfg.adapter_init,
                                             adapter_bias=cfg.adapter_bias)
            self._mark_core_replicas()
            if post_process and cfg.state_readout:
                self.state_readout = self._build_state_readout(config, seed)
            if post_process and cfg.n_coda:
                first_coda = first_core + cfg.n_core
                self.coda = LayerStack(config, spec, list(range(first_coda, first_coda + cfg.n_coda)),
                                       vp_stage, seed, "coda", recompute=cfg.recompute)
        else:
            lo, hi = self._untied_layer_range(cfg.num_layers)
            self.layers = LayerStack(config, spec, list(range(lo + 1, hi + 1)), vp_stage, seed, "layers",
                                     first_index=lo, recompute=cfg.recompute)
        if post_process:
            self.final_norm = RMSNorm(config, cfg.hidden_size, eps=cfg.norm_eps)
            torch.manual_seed(stable_seed(seed, "output_layer"))
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                cfg.hidden_size, self.vocab_size, config=config, init_method=config.init_method,
                bias=False, skip_bias_add=False, gather_output=False,
                skip_weight_param_allocation=pre_process and self.share_embeddings_and_output_weights)
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    # ----------------------------------------------------------------- structure
    def _untied_layer_range(self, n: int) -> tuple[int, int]:
        if n % self.num_stages:
            from megaloop.config_utils import ConfigError

            raise ConfigError(f"model.num_layers: {n} layers do not split over {self.num_stages} pipeline stages")
        per = n // self.num_stages
        return self.stage * per, (self.stage + 1) * per

    def _build_state_readout(self, config: TransformerConfig, seed: int) -> torch.nn.Linear:
        """Readout C (``model.state_readout``): a bias-free d×d Linear on the final state, replicated
        over TP (gradient all-reduced under sequence parallelism), initialised by the config's
        weight init, no weight decay."""
        d = self.cfg.hidden_size
        torch.manual_seed(stable_seed(seed, "state_readout"))
        lin = torch.nn.Linear(d, d, bias=False, dtype=config.params_dtype)
        with torch.no_grad():
            config.init_method(lin.weight)
        lin.weight.no_weight_decay = True
        lin.weight.sequence_parallel = config.sequence_parallel
        return lin

    def read_state(self, h: torch.Tensor) -> torch.Tensor:
        """The coda's input: ``C h`` with ``model.state_readout``, else ``h``; with
        ``model.state_final_norm`` h is first normalised by the final norm (its weight shared with
        the one before the head; both live on the last pipeline stage). [s, b, d] -> [s, b, d]."""
        if self.cfg.state_final_norm:
            h = self.final_norm(h)
        return self.state_readout(h) if self.cfg.state_readout else h

    def _mark_core_replicas(self) -> None:
        """Tag core/injection params: summed over the pipeline group, counted once in norms."""
        for p in list(self.core.parameters()) + list(self.injection.parameters()):
            p.megaloop_core_replica = True
            if self.stage > 0:
                p.shared = True  # megatron's grad-norm dedup skips `shared` params

    def core_replica_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.parameters() if getattr(p, "megaloop_core_replica", False)]

    def set_input_tensor(self, input_tensor) -> None:
        """Called by megatron's pipeline schedules with the tensor received from the previous stage."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self._input_tensor = input_tensor

    def recurrence_slice(self, depth: int, window: int) -> tuple[int, int]:
        """This stage's recurrences ``[lo, hi)`` of a depth-``depth`` microbatch whose last ``window``
        recurrences backpropagate (:func:`megaloop.model.pipeline_split.split_recurrences`)."""
        return split_recurrences(depth, self.num_stages, self.split_costs, window)[self.stage]

    # ----------------------------------------------------------------- pieces
    def _sp(self) -> tuple[int, int]:
        if self.config.sequence_parallel:
            return (parallel_state.get_tensor_model_parallel_rank(),
                    parallel_state.get_tensor_model_parallel_world_size())
        return 0, 1

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embedding [b, s] -> [s, b, d] (first stage), times ``model.embed_scale``."""
        x = self.embedding(input_ids=input_ids, position_ids=None)
        m = self.cfg.embedding_multiplier
        return x * m if m != 1.0 else x

    def init_state(self, e: torch.Tensor, noise_seed: int | list[int] | None) -> torch.Tensor:
        """h⁰: N(0, std²) or zeros. ``noise_seed`` is one seed per microbatch or one per sample
        (so the draw does not depend on how samples are spread over data-parallel ranks); the
        full-sequence draw is sliced for sequence parallelism, so every TP/PP layout sees the
        same state. Eval mode uses ``eval_state_init``; its Gaussian is :func:`eval_noise`
        (per position, identical for every sequence of the batch)."""
        cfg = self.cfg
        mode = cfg.state_init if self.training else cfg.eval_state_init
        if mode == "zero":
            return torch.zeros_like(e)
        if not self.training:
            rank, size = self._sp()
            s = e.shape[0]
            table = eval_noise(cfg.eval_seed, rank * s, (rank + 1) * s, e.shape[-1])  # [s, d]
            return (table[:, None, :].to(e.device) * cfg.state_init_std).to(e.dtype).expand_as(e).contiguous()
        if noise_seed is None:
            noise_seed = stable_seed(self.seed, "state", next(self._noise_counter))
        rank, size = self._sp()
        s, b, d = e.shape
        seeds = noise_seed if isinstance(noise_seed, (list, tuple)) else [noise_seed]
        if len(seeds) not in (1, b):
            raise ValueError(f"noise_seed: expected 1 or {b} seeds, got {len(seeds)}")
        draws = []
        for seed_i in seeds:
            gen = torch.Generator(device=e.device).manual_seed(int(seed_i))
            shape = (s * size, b if len(seeds) == 1 else 1, d)
            draws.append(torch.randn(shape, generator=gen, device=e.device, dtype=torch.float32))
        full = torch.cat(draws, dim=1)
        return (full[rank * s:(rank + 1) * s] * cfg.state_init_std).to(e.dtype)

    def encode(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding + prelude of a single-stage model: ids [b, s] -> e [s, b, d]."""
        x = self.embed(input_ids)
        return self.prelude(x, self.rope(x.shape[0])) if self.cfg.n_prelude else x

    def context(self, e: torch.Tensor):
        """The injection's per-pass context of ``e`` (:meth:`recur` takes it)."""
        return self.injection.prepare(e)

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """Readout C → coda → final norm → head of a single-stage model: state [s, b, d] -> logits [b, s, V/tp]."""
        h = self.read_state(h)
        if self.cfg.n_coda:
            h = self.coda(h, self.rope(h.shape[0]))
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(self.final_norm(h), weight=weight)
        return logits.transpose(0, 1)

    def recur(self, h: torch.Tensor, e: torch.Tensor, ctx, rope: torch.Tensor) -> torch.Tensor:
        """One recurrence h^{r+1} = exit(Γ(Inject(h^r, e)))."""
        z = self.injection(h, ctx)
        z = self.core(z, rope, self.causal_mask(z.shape[0], z.device),
                      inject=e if self.injection.uses_qkv_injection else None)
        return self.injection.exit(z)

    def run_recurrences(self, h: torch.Tensor, e: torch.Tensor, lo: int, hi: int, depth: int,
                        bptt_window: int, rope: torch.Tensor) -> torch.Tensor:
        """Recurrences lo..hi-1 of a depth-``depth`` pass backpropagating the last ``bptt_window``."""
        ctx = self.injection.prepare(e)
        first_grad = depth - bptt_window
        for i in range(lo, hi):
            if i < first_grad or not torch.is_grad_enabled():
                with torch.no_grad():
                    h = self.recur(h, e, ctx, rope)
            else:
                if i == first_grad:
                    h = h.detach()
                h = self.recur(h, e, ctx, rope)
        return h

    def rope(self, s_local: int) -> torch.Tensor:
        _, size = self._sp()
        return self.rotary(s_local * size)

    # ----------------------------------------------------------------- forward
    def causal_mask(self, s_local: int, device: torch.device) -> torch.Tensor | None:
        """Explicit causal mask [1, 1, s, s] (True = masked) for the local spec; TE builds its own.
        Passing it keeps megatron from building one with ``device="cuda"`` on every forward."""
        if self._te:
            return None
        s = s_local * self._sp()[1]
        key = (s, device)
        if self._mask_cache.get("key") != key:
            m = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)[None, None]
            self._mask_cache = {"key": key, "mask": m}
        return self._mask_cache["mask"]

    def forward(self, *args, **kwargs) -> torch.Tensor:
        """See :meth:`_forward`. Runs without the CPU layer's TorchFunctionMode (it needs none)."""
        with without_redirect():
            return self._forward(*args, **kwargs)

    def _forward(self, input_ids: torch.Tensor | None, labels: torch.Tensor | None = None, *,
                depth: int = 1, bptt_window: int | None = None, noise_seed: int | list[int] | None = None,
                return_hidden: bool = False) -> torch.Tensor:
        cfg = self.cfg
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        window = min(depth, bptt_window if bptt_window is not None else cfg.bptt_window)
        if self.pre_process:
            x = self.embed(input_ids)
        else:
            x = self._input_tensor
        mask = self.causal_mask(x.shape[0] // (2 if cfg.looped and not self.pre_process else 1), x.device)
        if cfg.looped:
            if self.pre_process:
                rope = self.rope(x.shape[0])
                e = self.prelude(x, rope, mask) if cfg.n_prelude else x
                h = self.init_state(e, noise_seed)
            else:
                h, e = x.chunk(2, dim=0)
                rope = self.rope(h.shape[0])
            lo, hi = self.recurrence_slice(depth, window)
            h = self.run_recurrences(h, e, lo, hi, depth, window, rope)
            if not self.post_process:
                return torch.cat([h, e], dim=0)
            h = self.read_state(h)
            if cfg.n_coda:
                h = self.coda(h, rope, mask)
        else:
            h = self.layers(x, self.rope(x.shape[0]), mask)
            if not self.post_process:
                return h
        h = self.final_norm(h)
        if return_hidden:
            return h
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(h, weight=weight)  # [s, b, V/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)  # [b, s]
