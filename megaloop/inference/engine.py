"""Inference engine for looped LMs: prefill / decode with separate recurrence budgets (SPEC §7).

Design decision — evaluation and generation run on the pure-PyTorch model
(:class:`megaloop.hf.modeling_megaloop.MegaloopForCausalLM`), loaded by :func:`megaloop.hf.load.load_model`
from a native megaloop checkpoint of *any* TP/PP layout (gathered into a TP=1/PP=1 native model in
this process, mapped onto the HF modules and checked against the native logits) or an exported HF
folder, and moved to one device. Reasons: terminal and per-visit KV banks need explicit
control of which recurrence's K/V each token keeps and which bank every recurrence of a later
token reads; megatron-core's inference contexts key one KV slot per ``layer_number`` and offer
neither. The paper's models (up to ~1B parameters) fit on one GPU, so no model parallelism is
needed at inference. The same engine serves PPL, depth sweeps, the fixed-point checks, the
lm-eval adapter, ``megaloop generate`` and (``megaloop.post.rl``) rollouts.

Use::

    eng = InferenceEngine.from_checkpoint("runs/x/checkpoints", device="cuda", dtype="bf16",
                                          prefill_depth=8, decode_depth=4, cache_mode="terminal")
    out = eng.generate(["def f(x):", "Looped models"], max_new_tokens=32, temperature=0.7,
                       top_p=0.9, seed=0, stop=["\\n\\n"])
    out.results[0].text, out.stats.decode_tokens_per_s, out.stats.kv_bytes_per_token

    state = eng.prefill([[5, 6, 7]], depth=8)            # parallel pass, keeps terminal banks
    logits = eng.decode(state, torch.tensor([9]), depth=4)  # one decode step per call

    out = eng.generate("Looped models", exit_criterion="latent:1e-3", max_depth=32)  # adaptive depth
    out.results[0].depths, out.stats.mean_depth, out.stats.depth_histogram  # see inference/adaptive.py

Batches are left-padded: padding keys are masked, positions (rotary and the eval-time state
init) count real tokens only, so a sequence gives the same tokens alone or in a batch.
"""

from __future__ import annotations

import numbers
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from megaloop.config_utils import ConfigError
from megaloop.hf.load import load_model
from megaloop.inference.adaptive import DepthLog, ExitPolicy, adaptive_decode, exit_policy
from megaloop.inference.kv_cache import (MODES, cache_stats, check_depth, check_mode, held_depth, kv_bytes_per_token,
                                         memory_report, select_rows)
from megaloop.inference.sampling import SamplingParams, pick_tokens, row_generators

Prompt = Union[str, Sequence[int]]


# ----------------------------------------------------------------------------- results
@dataclass
class DecodeState:
    """A batch being decoded: its cache, padding mask, per-row lengths and last logits."""

    cache: Any
    attention_mask: Optional[torch.Tensor]  # [b, cached tokens] (None: no padding anywhere)
    lengths: torch.Tensor  # [b] real tokens so far = position of the next token
    logits: torch.Tensor  # [b, vocab] FP32 logits of the last position (real vocabulary only)
    prefill_depth: int
    decode_depth: int
    last_depths: Optional[torch.Tensor] = None  # [b] depths of the last adaptive decode step

    @property
    def batch_size(self) -> int:
        return int(self.lengths.numel())

    def select(self, rows: Sequence[int]) -> "DecodeState":
        """The state of ``rows`` only (new cache; this state unchanged)."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        dev = self.lengths.device
        mask = None if self.attention_mask is None else self.attention_mask.index_select(0, idx.to(dev))
        return DecodeState(select_rows(self.cache, idx), mask, self.lengths.index_select(0, idx.to(dev)),
                           self.logits.index_select(0, idx.to(self.logits.device)), self.prefill_depth,
                           self.decode_depth)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # eos | stop | length | context
    logits: Optional[torch.Tensor] = None  # [generated, vocab] when return_logits
    depths: Optional[list[int]] = None  # adaptive: recurrences of each fed token (decode steps)


@dataclass
class GenerationStats:
    cache_mode: str
    prefill_depth: int
    decode_depth: int
    batch_size: int
    prompt_tokens: int
    generated_tokens: int
    decode_steps: int
    decode_tokens: int  # (row, token) pairs fed through the decode forwards
    prefill_s: float
    decode_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float  # decode_tokens / decode_s (each row's first token comes from the
    # prefill's logits: generated_tokens counts it, the decode rate does not)
    kv_bytes_peak: int  # peak bytes held by the cache (incl. padding slots)
    kv_bytes_per_token: int  # measured, per cached token of one sequence
    kv_bytes_per_token_per_visit: int  # predicted for the full per-visit cache: one bank per visit of the
    # deepest pass it holds, max(prefill depth, decode depth or the exit policy's max_depth)
    kv_bytes_per_token_terminal: int  # predicted for terminal sharing
    exit_criterion: Optional[str] = None  # adaptive depth (decode_depth is then its max_depth)
    finished_rows: Optional[str] = None  # mask | compact
    mean_depth: Optional[float] = None  # over the adaptive decode steps
    depth_histogram: Optional[dict] = None  # depth -> tokens
    row_recurrences: Optional[int] = None  # core (row, recurrence) evaluations computed

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationOutput:
    results: list[GenerationResult]
    stats: GenerationStats

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.results]


# ----------------------------------------------------------------------------- engine
class InferenceEngine:
    """Prefill / decode / generate / score over a :class:`MegaloopForCausalLM`.

    Args:
        model: the HF model (eval mode; any device / dtype).
        tokenizer: a :class:`megaloop.data.tokenizer.Tokenizer` (``encode``/``decode``/``eos_id``)
            or None (token-id prompts only).
        depth: default recurrence budget of scoring passes (default ``config.num_recurrences``).
        prefill_depth / decode_depth: default budgets of prefill and of one-token decode steps
            (default ``depth``).
        cache_mode: default KV-cache mode, ``terminal`` or ``per_visit``.
        max_context: longest sequence (prompt + generated) accepted; default the training
            sequence length (``config.max_position_embeddings``).
        source: where the model came from (:func:`megaloop.hf.load.load_model`'s ``source``).
        exit_criterion / min_depth / max_depth / finished_rows: default adaptive-depth policy of
            decode steps (:mod:`megaloop.inference.adaptive`; None = fixed decode depth); then
            ``generate`` and ``score_with_prefix`` decode adaptively, depths go to ``depth_log``.
    """

    def __init__(self, model, tokenizer=None, *, depth: Optional[int] = None, prefill_depth: Optional[int] = None,
                 decode_depth: Optional[int] = None, cache_mode: str = "terminal",
                 max_context: Optional[int] = None, source: Optional[dict] = None,
                 exit_criterion: Optional[str] = None, min_depth: Optional[int] = None,
                 max_depth: Optional[int] = None, finished_rows: str = "mask"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        cfg = model.config
        self.depth = check_depth(depth if depth is not None else cfg.num_recurrences, "--depth")
        self.prefill_depth = check_depth(prefill_depth if prefill_depth is not None else self.depth,
                                         "--prefill-depth")
        self.decode_depth = check_depth(decode_depth if decode_depth is not None else self.depth, "--decode-depth")
        self.cache_mode = check_mode(cache_mode, "--cache")
        self.max_context = int(max_context or cfg.max_position_embeddings)
        if self.max_context < 1:
            raise ConfigError(f"--max-context: must be >= 1, got {max_context}")
        self.source = source or {}
        self.exit = self.policy(exit_criterion, min_depth, max_depth, finished_rows)
        self.depth_log = DepthLog()

    def policy(self, exit_criterion=None, min_depth=None, max_depth=None, finished_rows=None) -> Optional[ExitPolicy]:
        """The adaptive policy of these options (ConfigError on bad ones); all None → the engine's."""
        if exit_criterion is None and min_depth is None and max_depth is None and finished_rows is None:
            return getattr(self, "exit", None)
        return exit_policy(exit_criterion, min_depth=min_depth, max_depth=max_depth,
                           default_max_depth=self.decode_depth, finished_rows=finished_rows or "mask")

    # ------------------------------------------------------------ construction
    @classmethod
    def load(cls, path: Union[str, Path], *, device="cpu", dtype=torch.float32, tokenizer=None, validate: bool = True,
             kind: Optional[str] = None, student=None, **kwargs) -> "InferenceEngine":
        """Engine over a native checkpoint of any TP/PP layout (converted in memory, validated unless
        ``validate=False``) or an exported HF folder, optionally prefilling through a distilled
        ``student`` folder: :func:`megaloop.hf.load.load_model`. ``tokenizer``: a tokenizer.json
        overriding the model's; ``kwargs`` go to the engine."""
        from megaloop.data.tokenizer import Tokenizer

        model, source = load_model(path, device=device, dtype=dtype, validate=validate, kind=kind, student=student,
                                   tokenizer=tokenizer)
        tok = tokenizer or source["tokenizer"]
        tk = Tokenizer(tok) if tok else None
        real = int(model.config.tokenizer_vocab_size)
        if tokenizer and tk is not None and tk.vocab_size > real:
            raise ConfigError(f"--tokenizer {tokenizer}: its vocabulary ({tk.vocab_size} tokens) is larger than the "
                              f"model's ({real}), so it is not the tokenizer the model was trained with")
        if tokenizer and tk is not None and tk.vocab_size < real:
            print(f"warning: --tokenizer {tokenizer}: its vocabulary ({tk.vocab_size} tokens) is smaller than the "
                  f"model's ({real}): probably not the tokenizer the model was trained with (its scores and "
                  "generations would be meaningless)", file=sys.stderr, flush=True)
        return cls(model, tk, source=source, **kwargs)

    @classmethod
    def from_checkpoint(cls, path: Union[str, Path], **kwargs) -> "InferenceEngine":
        """:meth:`load` of a native checkpoint (step dir, checkpoints dir or run dir)."""
        return cls.load(path, kind="checkpoint", **kwargs)

    @classmethod
    def from_hf(cls, path: Union[str, Path], **kwargs) -> "InferenceEngine":
        """:meth:`load` of an exported HF folder (``megaloop convert``); CheckpointError for anything else."""
        return cls.load(path, kind="hf", **kwargs)

    # ------------------------------------------------------------ properties
    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        """Real (tokenizer) vocabulary; logits above it are padding and never sampled."""
        return int(self.config.tokenizer_vocab_size)

    @property
    def eos_id(self) -> Optional[int]:
        if self.tokenizer is not None:
            return self.tokenizer.eos_id
        return self.config.eos_token_id

    @property
    def pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_id", None) if self.tokenizer is not None else self.config.pad_token_id
        if pad is None:
            pad = self.eos_id
        return int(pad or 0)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ConfigError("this engine has no tokenizer: pass token ids, or a tokenizer (--tokenizer)")
        return list(self.tokenizer.encode(text))

    def decode_text(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(int(i)) for i in ids)
        return self.tokenizer.decode(list(ids))

    # ------------------------------------------------------------ memory
    def kv_bytes_per_token(self, mode: Optional[str] = None, depth: Optional[int] = None) -> int:
        """Predicted KV bytes per token of one sequence (engine dtype)."""
        return kv_bytes_per_token(self.config, check_mode(mode or self.cache_mode, "--cache"),
                                  depth or self.decode_depth, self.dtype)

    def memory(self, mode: Optional[str] = None, depth: Optional[int] = None, tokens: int = 1, batch_size: int = 1):
        """:class:`megaloop.inference.kv_cache.MemoryReport` of a configuration."""
        return memory_report(self.config, check_mode(mode or self.cache_mode, "--cache"),
                             depth or self.decode_depth, tokens, batch_size, self.dtype)

    # ------------------------------------------------------------ inputs
    @staticmethod
    def _prompt_list(prompts) -> list:
        """One prompt (a string or a sequence of token ids: list, tensor, numpy array) or a batch of
        them, as a list of prompts (``prefill`` read ``[5, 6, 7]`` as three prompts: a TypeError)."""
        if hasattr(prompts, "tolist") and not isinstance(prompts, (str, list, tuple)):  # torch / numpy
            prompts = prompts.tolist()
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        one = bool(prompts) and isinstance(prompts[0], numbers.Integral) and not isinstance(prompts[0], bool)
        return [prompts] if one else prompts

    def _as_ids(self, prompt: Prompt) -> list[int]:
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:  # packed training data starts documents after EOS
            if self.eos_id is None:
                raise ConfigError("prompt is empty and the model has no EOS token to start from")
            ids = [int(self.eos_id)]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ConfigError(f"prompt: token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        return ids

    def check_context(self, n_tokens: int, what: str = "prompt") -> None:
        if n_tokens > self.max_context:
            raise ConfigError(f"{what} has {n_tokens} tokens, longer than the model's context of "
                              f"{self.max_context} tokens (max_context / --max-context)")

    def _batch(self, prompts: Sequence[Sequence[int]]):
        """Left-padded ids [b, L], attention mask [b, L] (None without padding), positions [b, L]."""
        lens = [len(p) for p in prompts]
        width = max(lens)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        dev = self.device
        if min(lens) == width:
            pos = torch.arange(width)[None].expand(len(prompts), width)
            return ids.to(dev), None, pos.to(dev), torch.tensor(lens, device=dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        return ids.to(dev), mask.to(dev), pos.to(dev), torch.tensor(lens, device=dev)

    def _suppress_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """FP32 logits over the real vocabulary (padded rows of the head dropped)."""
        return logits[..., :self.vocab_size].float()

    # ------------------------------------------------------------ passes
    @torch.no_grad()
    def forward(self, ids: torch.Tensor, depth: Optional[int] = None) -> torch.Tensor:
        """Native parallel forward (no cache) at ``depth``: FP32 logits [b, s, V_padded] over the padded
        head, as training's CE and :meth:`score_with_prefix` see them (rows >= :attr:`vocab_size` are
        padding; :meth:`prefill` / :meth:`decode`, which feed sampling, drop them)."""
        depth = check_depth(depth if depth is not None else self.depth, "--depth")
        return self.model(ids.to(self.device), use_cache=False, num_recurrences=depth).logits.float()

    @torch.no_grad()
    def prefill(self, prompts: Union[torch.Tensor, Sequence[Prompt]], *, depth: Optional[int] = None,
                decode_depth: Optional[int] = None, cache_mode: Optional[str] = None) -> DecodeState:
        """Parallel pass over the prompts at ``depth`` (the prefill budget), as in training;
        the cache then keeps each token's terminal banks (``terminal``) or every visit
        (``per_visit``). Returns the :class:`DecodeState` with the last-position logits."""
        depth = check_depth(depth if depth is not None else self.prefill_depth, "--prefill-depth")
        ddepth = check_depth(decode_depth if decode_depth is not None else self.decode_depth, "--decode-depth")
        mode = check_mode(cache_mode or self.cache_mode, "--cache")
        ids_list = [self._as_ids(p) for p in self._prompt_list(prompts)]
        if not ids_list:
            raise ConfigError("no prompts given")
        for p in ids_list:
            self.check_context(len(p))
        ids, mask, pos, lens = self._batch(ids_list)
        cache = self.model.new_cache(mode)
        out = self.model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                         num_recurrences=depth, logits_to_keep=1)
        return DecodeState(cache, mask, lens, self._suppress_padding(out.logits[:, -1]), depth, ddepth)

    @torch.no_grad()
    def decode(self, state: DecodeState, tokens: torch.Tensor, *, depth: Optional[int] = None,
               policy: Optional[ExitPolicy] = None) -> torch.Tensor:
        """Feed one token per row ([b]) at the decode budget — or, with an :class:`ExitPolicy`, at
        adaptive per-row depth (``state.last_depths``, ``depth_log``); updates ``state``; returns FP32
        logits [b, V] over the real vocabulary."""
        depth = check_depth(depth if depth is not None else state.decode_depth, "--decode-depth")
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1, 1)  # a list or an int too
        if tokens.device.type == "cpu" and not bool(((tokens >= 0) & (tokens < self.vocab_size)).all()):
            bad = [t for t in tokens.flatten().tolist() if not 0 <= t < self.vocab_size]
            raise ConfigError(f"decode: token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        tokens = tokens.to(self.device)
        b = tokens.shape[0]
        if b != state.batch_size:
            raise ValueError(f"decode: {b} tokens for a batch of {state.batch_size}")
        mask = state.attention_mask
        if mask is not None:
            mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype, device=mask.device)], dim=1)
        if policy is not None:
            logits, state.last_depths, work = adaptive_decode(self.model, tokens, state.cache, policy, mask,
                                                              state.lengths.reshape(b, 1))
            self.depth_log.add(state.last_depths, work)
        else:
            logits = self.model(tokens, attention_mask=mask, position_ids=state.lengths.reshape(b, 1),
                                past_key_values=state.cache, use_cache=True, num_recurrences=depth).logits
        state.attention_mask = mask
        state.lengths = state.lengths + 1
        state.logits = self._suppress_padding(logits[:, -1])
        return state.logits

    @torch.no_grad()
    def score_with_prefix(self, prefix: Optional[torch.Tensor], chunk: torch.Tensor, *, depth: Optional[int] = None,
                          prefill_depth: Optional[int] = None, cache_mode: Optional[str] = None,
                          cache=None, policy: Optional[ExitPolicy] = None,
                          scored: Optional[torch.Tensor] = None,
                          stepwise: bool = False) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """The PPL protocol's two passes: prefill ``prefix`` [b, m] at ``prefill_depth`` (default
        ``depth``) into a cache, then one parallel pass over ``chunk`` [b, n] at ``depth`` whose
        tokens read the prefix through the cached banks (terminal: one bank per layer) and each
        other per recurrence, as in training. Returns FP32 logits over the padded head
        ``(last_prefix_logits [b, V] — the prediction of chunk[:, 0] — , chunk_logits [b, n, V])``.
        Pass ``cache`` (already holding the prefix; ``prefix`` None) to skip the prefill; the
        cache then also holds ``chunk``. With a ``policy`` (default the engine's ``exit``) the chunk
        is fed token by token at adaptive depth (teacher forcing; depths in ``depth_log``); ``scored``
        [b, n] (bool) limits the depths logged to the positions that are scored (the row
        recurrences computed are logged in full). ``stepwise`` without a policy feeds the chunk token
        by token at fixed ``depth`` (the decode protocol a policy falls back to when none of its
        criteria can fire, e.g. a sweep row with R below ``min_depth``)."""
        depth = check_depth(depth if depth is not None else self.depth, "--depth")
        pdepth = check_depth(prefill_depth if prefill_depth is not None else depth, "--prefill-depth")
        last = None
        if cache is None:
            if prefix is None:
                raise ValueError("score_with_prefix: pass a prefix or a filled cache")
            cache = self.model.new_cache(check_mode(cache_mode or self.cache_mode, "--cache"))
            last = self.model(prefix.to(self.device), past_key_values=cache, use_cache=True,
                              num_recurrences=pdepth, logits_to_keep=1).logits[:, -1].float()
        policy = policy or self.exit
        if policy is None and stepwise:
            chunk = chunk.to(self.device)
            return last, torch.cat([self.model(chunk[:, j:j + 1], past_key_values=cache, use_cache=True,
                                               num_recurrences=depth).logits.float()
                                    for j in range(chunk.shape[1])], dim=1)
        if policy is None:
            return last, self.model(chunk.to(self.device), past_key_values=cache, use_cache=True,
                                    num_recurrences=depth).logits.float()
        steps = []
        for j in range(chunk.shape[1]):
            logits, depths, work = adaptive_decode(self.model, chunk[:, j:j + 1].to(self.device), cache, policy)
            if scored is not None:
                depths = depths[scored[:, j].to(depths.device).bool()]
            self.depth_log.add(depths, work)
            steps.append(logits.float())
        return last, torch.cat(steps, dim=1)

    # ------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompts: Union[Prompt, Sequence[Prompt]], *, max_new_tokens: int = 64,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
                 greedy: Optional[bool] = None, stop: Sequence[str] = (), stop_at_eos: bool = True,
                 prefill_depth: Optional[int] = None, decode_depth: Optional[int] = None,
                 cache_mode: Optional[str] = None, return_logits: bool = False, exit_criterion: Optional[str] = None,
                 min_depth: Optional[int] = None, max_depth: Optional[int] = None,
                 finished_rows: Optional[str] = None) -> GenerationOutput:
        """Generate continuations of one prompt (str / ids) or a batch of them.

        Decoding: greedy when ``temperature == 0`` or ``greedy``; else sampling with temperature,
        ``top_k`` (0 = off), ``top_p`` (1 = off) and ``seed`` (reproducible). A row stops at EOS
        (``stop_at_eos``), at the first ``stop`` string (the text is cut before it), after
        ``max_new_tokens``, or when its length reaches ``max_context`` (finish reason ``context``).
        ``exit_criterion`` (``latent:1e-3`` …, ``min_depth``, ``max_depth``, ``finished_rows``; default
        the engine's policy, ``"none"`` = fixed depth): decode steps at adaptive per-token depth.
        """
        batch = self._prompt_list(prompts)
        if max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens: must be >= 1, got {max_new_tokens}")
        params = SamplingParams(0.0 if greedy else temperature, top_k, top_p, seed)
        mode = check_mode(cache_mode or self.cache_mode, "--cache")
        policy = self.policy(exit_criterion, min_depth, max_depth, finished_rows)
        log = DepthLog()
        stop = [s for s in ([stop] if isinstance(stop, str) else list(stop or [])) if s]
        base_seed = (int(seed) if seed is not None else int.from_bytes(os.urandom(7), "little"))

        work0 = self.depth_log.row_recurrences
        t0 = self._sync_time()
        state = self.prefill(batch, depth=prefill_depth, decode_depth=decode_depth, cache_mode=mode)
        t1 = self._sync_time()
        n = state.batch_size
        prompt_lens = [int(x) for x in state.lengths.tolist()]
        out_ids: list[list[int]] = [[] for _ in range(n)]
        out_logits: list[list[torch.Tensor]] = [[] for _ in range(n)]
        out_depths: list[list[int]] = [[] for _ in range(n)]
        texts, reasons = [""] * n, [""] * n
        rows = list(range(n))  # original row of each state row
        # one stream per row: a row's sample does not depend on the others or on when they finish
        gens = None if params.greedy else row_generators(base_seed, n, self.device)
        peak = state.cache.kv_bytes()
        steps = fed = 0  # decode forwards; (row, token) pairs fed through them
        eos = self.eos_id
        while True:
            nxt = pick_tokens(state.logits, params, None if gens is None else [gens[r] for r in rows]).tolist()
            keep = []
            for j, row in enumerate(rows):
                tok = int(nxt[j])
                if return_logits:
                    out_logits[row].append(state.logits[j].cpu())
                if stop_at_eos and eos is not None and tok == eos:
                    reasons[row] = "eos"
                    continue
                out_ids[row].append(tok)
                if stop:
                    text = self.decode_text(out_ids[row])
                    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
                    if cut >= 0:
                        texts[row], reasons[row] = text[:cut], "stop"
                        continue
                if len(out_ids[row]) >= max_new_tokens:
                    reasons[row] = "length"
                elif prompt_lens[row] + len(out_ids[row]) > self.max_context:
                    reasons[row] = "context"  # feeding this token would exceed the context
                else:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(rows):
                state = state.select(keep)
                rows = [rows[j] for j in keep]
                nxt = [nxt[j] for j in keep]
            self.decode(state, torch.tensor(nxt, dtype=torch.long), policy=policy)
            fed += len(rows)
            if policy is not None:
                log.add(state.last_depths)
                for row, d in zip(rows, state.last_depths.tolist()):
                    out_depths[row].append(int(d))
            steps += 1
            peak = max(peak, state.cache.kv_bytes())
        t2 = self._sync_time()
        results = []
        for row in range(n):
            text = texts[row] if reasons[row] == "stop" else self.decode_text(out_ids[row])
            logits = torch.stack(out_logits[row]) if return_logits and out_logits[row] else None
            results.append(GenerationResult(text, out_ids[row], prompt_lens[row], reasons[row], logits,
                                            out_depths[row] if policy is not None else None))
        generated = sum(len(r.token_ids) for r in results)
        measured = cache_stats(state.cache).bytes_per_token
        held = held_depth(state.prefill_depth, state.decode_depth, policy)
        stats = GenerationStats(
            cache_mode=mode, prefill_depth=state.prefill_depth, decode_depth=state.decode_depth, batch_size=n,
            prompt_tokens=sum(prompt_lens), generated_tokens=generated, decode_steps=steps, decode_tokens=fed,
            prefill_s=t1 - t0, decode_s=t2 - t1, prefill_tokens_per_s=sum(prompt_lens) / max(t1 - t0, 1e-9),
            decode_tokens_per_s=fed / max(t2 - t1, 1e-9), kv_bytes_peak=int(peak),
            kv_bytes_per_token=int(measured),
            kv_bytes_per_token_per_visit=self.kv_bytes_per_token("per_visit", held),
            kv_bytes_per_token_terminal=self.kv_bytes_per_token("terminal", held))
        if policy is not None:
            stats.decode_depth, stats.exit_criterion = policy.max_depth, policy.spec
            stats.finished_rows = "compact" if policy.compaction else "mask"
            stats.mean_depth, stats.depth_histogram = log.mean, log.histogram
            stats.row_recurrences = self.depth_log.row_recurrences - work0
        return GenerationOutput(results, stats)

    def _sync_time(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def describe(self) -> dict:
        """JSON-able summary: source, shapes, budgets, memory per token."""
        cfg = self.config
        return {"source": dict(self.source),
                "arch": cfg.arch, "injection": cfg.injection, "hidden_size": cfg.hidden_size,
                "layers": [cfg.n_prelude, cfg.n_core, cfg.n_coda] if cfg.looped else cfg.num_hidden_layers,
                "vocab_size": self.vocab_size, "dtype": str(self.dtype).replace("torch.", ""),
                "device": str(self.device), "depth": self.depth, "prefill_depth": self.prefill_depth,
                "decode_depth": self.decode_depth, "cache_mode": self.cache_mode, "max_context": self.max_context,
                "exit": None if self.exit is None else {"criterion": self.exit.spec, "min_depth": self.exit.min_depth,
                                                        "max_depth": self.exit.max_depth,
                                                        "compaction": self.exit.compaction},
                "kv_bytes_per_token": {m: self.kv_bytes_per_token(m, held_depth(self.prefill_depth, self.decode_depth,
                                                                                self.exit)) for m in MODES}}


__all__ = ["DecodeState", "GenerationOutput", "GenerationResult", "GenerationStats", "InferenceEngine",
           "SamplingParams", "pick_tokens"]
