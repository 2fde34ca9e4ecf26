"""GRPO-style policy gradient for looped LMs with endpoint reuse (SPEC §9).

One step: sample ``prompts_per_step`` prompts, ``group_size`` completions each, with the HF model's
KV cache (``terminal`` by default, depth ``R`` for prefill and decode) while saving every token's
endpoint state ``z^R`` (the state after the last recurrence: ``hidden_states[-2]`` of each
forward); score completions exactly with the task's :class:`~megaloop.post.rl.tasks.RewardFn`;
group-normalise the rewards into advantages ``A_i = (r_i − mean_g r) / (std_g r + ε)``; and take
one optimizer step on the surrogate

    L = −(1/n) Σ_i A_i · (1/|o_i|) Σ_t log π(o_{i,t} | ·)      (``loss_norm="sequence"``)
    (or −(1/Σ|o_i|) Σ_i Σ_t A_i log π(...) with ``loss_norm="token"``), + ``kl_coef`` · k3-KL to a
    frozen reference (off by default: KL-free).

The update is on-policy (one optimizer step per rollout batch, so the PPO ratio is 1 and needs
no clipping). Its gradient comes from one of three arms (:mod:`megaloop.post.rl.reuse`):

* ``reuse`` — one recurrence applied in parallel over prompt + completion at the rollout's saved
  endpoints, then Neumann-(b−1): cost and memory independent of ``R``;
* ``recompute`` — a no-grad parallel pass at depth ``R`` rebuilds the endpoints first;
* ``bptt`` — a parallel pass through all ``R`` recurrences with gradient.

Prompt tokens' saved endpoints are those of the prefill (the parallel pass itself); generated
tokens' endpoints come from cached decoding, which under terminal KV sharing differs slightly
from a parallel pass (SPEC §7) — the recompute arm measures that gap. Sequences are batched by
prompt length (no left padding); tokens after a completion's EOS are masked out.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from megaloop.post.rl.parts import HFLoopedParts
from megaloop.post.rl.reuse import ARMS, backward
from megaloop.post.rl.tasks import Example, Task, TextTokenizer


@dataclass
class GRPOConfig:
    arm: str = "reuse"  # reuse | recompute | bptt
    depth: int = 5  # R: rollout prefill/decode depth and the recompute/bptt depth
    neumann_b: int = 5  # b of Neumann-(b−1) (reuse, recompute); b=5 is the paper's Neumann-4
    bptt_window: int | None = None  # None: full BPTT through all R
    group_size: int = 8  # G completions per prompt
    prompts_per_step: int = 4
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_k: int | None = None
    cache_mode: str = "terminal"
    scale_rewards: bool = True  # divide by the group std
    loss_norm: str = "sequence"  # sequence | token
    kl_coef: float = 0.0  # > 0 keeps a frozen reference copy (k3 estimator)
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    clip_grad: float | None = 1.0
    steps: int = 100
    seed: int = 0
    log_every: int = 1

    def __post_init__(self) -> None:
        if self.arm not in ARMS:
            raise ValueError(f"arm: one of {ARMS}, got {self.arm!r}")
        if self.loss_norm not in ("sequence", "token"):
            raise ValueError(f"loss_norm: 'sequence' or 'token', got {self.loss_norm!r}")
        self._check_numbers()

    def _check_numbers(self) -> None:
        """Every numeric field in range; the messages name the ``megaloop rl`` flag too."""
        def bad(name: str, flag: str, want: str, got) -> ValueError:
            return ValueError(f"{flag} ({name}) must be {want}, got {got!r}")

        def finite(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if self.group_size < 2:
            raise bad("group_size", "--group-size", ">= 2 (advantages are normalised within a group)",
                      self.group_size)
        for name, flag in (("depth", "--depth"), ("neumann_b", "--neumann-b"), ("max_new_tokens", "--max-new-tokens")):
            if getattr(self, name) < 1:
                raise bad(name, flag, ">= 1", getattr(self, name))
        if self.prompts_per_step < 1:
            raise bad("prompts_per_step", "--prompts", ">= 1", self.prompts_per_step)
        if self.steps < 1:
            raise bad("steps", "--steps", ">= 1", self.steps)
        if self.top_k is not None and self.top_k < 0:
            raise bad("top_k", "--top-k", ">= 0 (0 or unset: no top-k cut)", self.top_k)
        if not (finite(self.temperature) and self.temperature > 0):
            raise bad("temperature", "--temperature", "finite and > 0 (greedy sampling makes every "
                      "completion of a group equal: no advantage)", self.temperature)
        if not (finite(self.lr) and self.lr > 0):
            raise bad("lr", "--lr", "finite and > 0", self.lr)
        if not (finite(self.weight_decay) and self.weight_decay >= 0):
            raise bad("weight_decay", "--weight-decay", "finite and >= 0", self.weight_decay)
        if not (finite(self.kl_coef) and self.kl_coef >= 0):
            raise bad("kl_coef", "--kl-coef", "finite and >= 0", self.kl_coef)
        if self.clip_grad is not None and not (finite(self.clip_grad) and self.clip_grad >= 0):
            raise bad("clip_grad", "--clip-grad", "finite and >= 0 (0: no clipping)", self.clip_grad)
        if self.bptt_window is not None and not 1 <= self.bptt_window <= self.depth:
            raise bad("bptt_window", "--bptt-window", f"between 1 and --depth ({self.depth})", self.bptt_window)


@dataclass
class RolloutBatch:
    """Sequences sharing one prompt length ``P``; completions padded to ``T`` tokens."""

    ids: torch.Tensor  # [B, P+T] prompt + completion
    prompt_len: int
    mask: torch.Tensor  # [B, T] 1 for generated tokens up to and including EOS
    endpoints: torch.Tensor  # [B, P+T-1, d] z^R of every token fed to the model
    rewards: torch.Tensor  # [B]
    advantages: torch.Tensor  # [B]
    groups: list[int]  # group (prompt) index of each row
    completions: list[str] = field(default_factory=list)  # decoded text (up to EOS) of each row
    examples: list[Example] = field(default_factory=list)  # the example of each row
    rows: list[int] = field(default_factory=list)  # global rollout row of each row


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None,
            gen: torch.Generator | Sequence[torch.Generator]) -> torch.Tensor:
    """Next tokens [B] from logits [B, V]; ``gen`` one generator for the batch or one per row
    (per-row streams make a row's sample independent of the batch it is in)."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if isinstance(gen, torch.Generator):
        return torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(gen)])


def row_generator(seed: int, step: int, row: int) -> torch.Generator:
    """The sampling stream of global rollout row ``row`` at ``step`` (the same on any layout)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 2_654_435_761 % (2**61 - 1) + row)


@torch.no_grad()
def generate_with_endpoints(model, prompt_ids: torch.Tensor, *, max_new_tokens: int, depth: int,
                            eos_id: int | None, vocab_limit: int | None = None, temperature: float = 1.0,
                            top_k: int | None = None, cache_mode: str = "terminal",
                            generator: torch.Generator | Sequence[torch.Generator] | None = None):
    """Sample completions with the KV cache, saving each fed token's endpoint ``z^R``.

    Returns ``(completion [B, T], mask [B, T], endpoints [B, P+T-1, d])``; ``T ≤ max_new_tokens``
    (stops early once every row has emitted EOS). ``vocab_limit`` masks padded vocab rows;
    ``generator``: one for the batch or one per row."""
    gen = generator or torch.Generator().manual_seed(0)
    cache = model.new_cache(cache_mode)
    out = model(prompt_ids, past_key_values=cache, num_recurrences=depth, output_hidden_states=True,
                logits_to_keep=1)
    states = [out.hidden_states[-2]]
    logits = out.logits[:, -1]
    b = prompt_ids.shape[0]
    done = torch.zeros(b, dtype=torch.bool, device=prompt_ids.device)
    tokens, masks = [], []
    for t in range(max_new_tokens):
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits = logits.clone()
            logits[:, vocab_limit:] = float("-inf")
        tok = _sample(logits.cpu(), temperature, top_k, gen).to(prompt_ids.device)
        if eos_id is not None:
            tok = torch.where(done, torch.full_like(tok, eos_id), tok)
        masks.append(~done)
        tokens.append(tok)
        if eos_id is not None:
            done = done | (tok == eos_id)
        if t == max_new_tokens - 1 or bool(done.all()):
            break
        out = model(tok[:, None], past_key_values=cache, num_recurrences=depth,
                    output_hidden_states=True)
        states.append(out.hidden_states[-2])
        logits = out.logits[:, -1]
    completion = torch.stack(tokens, 1)
    mask = torch.stack(masks, 1).to(torch.float32)
    return completion, mask, torch.cat(states, 1)


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """``(r − mean_g) / (std_g + eps)`` within each group (std unbiased; ``scale=False``: centred only)."""
    adv = torch.zeros_like(rewards)
    for g in groups.unique():
        sel = groups == g
        r = rewards[sel]
        a = r - r.mean()
        if scale and r.numel() > 1:
            a = a / (r.std() + eps)
        adv[sel] = a
    return adv


def rollout(model, tokenizer: TextTokenizer, task: Task, examples: list[Example], cfg: GRPOConfig,
            generator: torch.Generator | None = None, *, rows: Sequence[int] | None = None,
            row_generators: Sequence[torch.Generator] | None = None) -> list[RolloutBatch]:
    """Generate completions, score them, return batches by prompt length.

    ``rows``: the global rollout rows to generate (row ``j`` is completion ``j % G`` of example
    ``j // G``; default all ``len(examples) · G``); with ``row_generators`` (one per row) each
    row samples from its own stream. Advantages are normalised within the groups present here;
    a data-parallel caller recomputes them over the whole group (:meth:`GRPOTrainer.step`)."""
    device = next(model.parameters()).device
    encoded = [tokenizer.encode(ex.prompt) for ex in examples]
    if any(len(p) == 0 for p in encoded):
        raise ValueError("empty prompt")
    rows = list(range(len(examples) * cfg.group_size)) if rows is None else list(rows)
    gens = dict(zip(rows, row_generators)) if row_generators is not None else None
    if generator is None and gens is None:
        generator = torch.Generator().manual_seed(0)
    vocab_limit = getattr(model.config, "tokenizer_vocab_size", None)
    by_len: dict[int, list[int]] = {}
    for j in rows:
        by_len.setdefault(len(encoded[j // cfg.group_size]), []).append(j)
    batches = []
    for plen, batch_rows in sorted(by_len.items()):
        groups = [j // cfg.group_size for j in batch_rows]
        prompt = torch.tensor([encoded[i] for i in groups], dtype=torch.long, device=device)
        comp, mask, ends = generate_with_endpoints(
            model, prompt, max_new_tokens=cfg.max_new_tokens, depth=cfg.depth,
            eos_id=tokenizer.eos_id, vocab_limit=vocab_limit, temperature=cfg.temperature, top_k=cfg.top_k,
            cache_mode=cfg.cache_mode, generator=[gens[j] for j in batch_rows] if gens else generator)
        texts = []
        for row, i in enumerate(groups):
            n = int(mask[row].sum())
            texts.append(tokenizer.decode([t for t in comp[row, :n].tolist() if t != tokenizer.eos_id]))
        pairs = [(examples[i], text) for i, text in zip(groups, texts)]
        if hasattr(task, "reward_many"):  # e.g. code rewards: a pool of sandboxes (--reward-workers)
            rewards = [float(r) for r in task.reward_many(pairs)]
        else:
            rewards = [float(task.reward(e, text)) for e, text in pairs]
        r = torch.tensor(rewards, dtype=torch.float32)
        adv = group_advantages(r, torch.tensor(groups), cfg.scale_rewards)
        batches.append(RolloutBatch(ids=torch.cat([prompt, comp], 1), prompt_len=plen, mask=mask.to(device),
                                    endpoints=ends, rewards=r, advantages=adv.to(device), groups=groups,
                                    completions=texts, examples=[examples[i] for i in groups],
                                    rows=batch_rows))
    return batches


def completion_logprobs(logits: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """log π of each completion token [B, T] from logits over ``ids[:, :-1]``."""
    p = batch.prompt_len
    targets = batch.ids[:, p:]
    lp = torch.log_softmax(logits[:, p - 1:].float(), dim=-1)
    return lp.gather(-1, targets[..., None]).squeeze(-1)


def surrogate_loss(batch: RolloutBatch, cfg: GRPOConfig, n_seqs: int, n_tokens: int,
                   ref_logprobs: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``loss_fn(logits)`` of one batch, normalised over the whole step (``n_seqs`` sequences,
    ``n_tokens`` completion tokens) so per-batch gradients add up to the step's gradient."""

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        lp = completion_logprobs(logits, batch)
        mask = batch.mask
        per_tok = -batch.advantages[:, None] * lp
        if ref_logprobs is not None and cfg.kl_coef > 0:
            delta = ref_logprobs - lp
            per_tok = per_tok + cfg.kl_coef * (torch.exp(delta) - delta - 1.0)
        if cfg.loss_norm == "token":
            return (per_tok * mask).sum() / max(n_tokens, 1)
        per_seq = (per_tok * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        return per_seq.sum() / max(n_seqs, 1)

    return loss_fn


class GRPOTrainer:
    """GRPO on ``model`` through a :class:`~megaloop.post.engine.PostEngine` (default: one-process AdamW).

    Data parallel (``engine.world > 1``): every rank draws the same prompts, generates and scores
    its contiguous share of the ``prompts_per_step · group_size`` rollout rows (row streams from
    :func:`row_generator`, so samples do not depend on the layout), the rewards are gathered and
    the advantages normalised over each whole group, losses are normalised by the global counts,
    and the engine averages the ranks' gradients. Prompts and samples are functions of
    ``(seed, step)``, so resuming at a step replays the uninterrupted run."""

    def __init__(self, model, tokenizer: TextTokenizer, task: Task, cfg: GRPOConfig,
                 log: Callable[[str], None] | None = print, engine=None, meta: dict | None = None,
                 record: dict | None = None):
        """``meta``: more settings of the run that change its training (``megaloop rl``: the task
        spec, the reward mode, the model), stored in every checkpoint and checked on :meth:`load` with
        the config. ``record``: more facts written into each checkpoint's sidecar (``rl_run.json``:
        ``megaloop rl`` adds its ``--deepspeed`` and process count)."""
        from megaloop.post.engine import PlainEngine

        if cfg.kl_coef > 0:
            self.ref = copy.deepcopy(model).eval().requires_grad_(False)
        else:
            self.ref = None
        self.engine = engine or PlainEngine(model, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                            clip_grad=cfg.clip_grad)
        rows = cfg.prompts_per_step * cfg.group_size
        if rows % self.engine.world:
            raise ValueError(f"prompts_per_step * group_size = {rows} rollout rows do not split over "
                             f"{self.engine.world} processes")
        self.tokenizer, self.task, self.cfg = tokenizer, task, cfg
        self.log = log
        self.meta = dict(meta or {})
        self._warned_timeouts = False
        self.record = dict(record or {})
        self.step_no = 0
        self.seconds = 0.0  # training time of the steps done, over every launch (restored by load)
        self.stop_signal, self.stop_saved = 0, False  # how the last train() ended (a signal stop or not)
        self._bind()

    def _bind(self) -> None:
        self.model = self.engine.compute_module.eval()
        self.parts = HFLoopedParts(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def local_rows(self) -> list[int]:
        n = self.cfg.prompts_per_step * self.cfg.group_size // self.engine.world
        return list(range(self.engine.rank * n, (self.engine.rank + 1) * n))

    @torch.no_grad()
    def _ref_logprobs(self, batch: RolloutBatch) -> torch.Tensor | None:
        if self.ref is None:
            return None
        logits = self.ref(batch.ids[:, :-1], use_cache=False, num_recurrences=self.cfg.depth).logits
        return completion_logprobs(logits, batch)

    def update(self, batches: list[RolloutBatch]) -> dict:
        """One optimizer step over the rollout batches with the configured arm."""
        from megaloop.post.engine import all_reduce_sum

        cfg = self.cfg
        for p in self.params:
            p.grad = None
        n_seqs = cfg.prompts_per_step * cfg.group_size
        n_local_tokens = sum(float(b.mask.sum()) for b in batches)
        stats, skipped, t0 = [], 0, time.perf_counter()
        n_tokens = int(all_reduce_sum([n_local_tokens], self.engine.world)[0])
        for batch in batches:
            if cfg.kl_coef == 0 and bool((batch.advantages == 0).all()):
                skipped += 1  # zero gradient: every group of this batch has equal rewards
                continue
            loss_fn = surrogate_loss(batch, cfg, n_seqs, n_tokens, self._ref_logprobs(batch))
            inputs = batch.ids[:, :-1]
            stats.append(backward(cfg.arm, self.parts, inputs, loss_fn, depth=cfg.depth,
                                  b=cfg.neumann_b, z_end=batch.endpoints, bptt_window=cfg.bptt_window))
        # counts over every rank (batches was rank 0's own beside a global skipped_batches: "11 of 10 skipped")
        loss, n_stats, skipped_all, n_batches = all_reduce_sum(
            [sum(s.loss for s in stats), len(stats), skipped, len(batches)], self.engine.world)
        grad_norm = None
        if n_stats:  # a collective decision: every rank steps, or none
            grad_norm = self.engine.apply_grads(scale=float(self.engine.world))
        out = {"update_s": time.perf_counter() - t0, "loss": loss, "grad_norm": grad_norm,
               "batches": int(n_batches), "skipped_batches": int(skipped_all)}
        res = [s.residual for s in stats if s.residual is not None]
        if self.engine.world > 1:  # the largest over every rank (rank 0 may have skipped all of its own)
            from megaloop.post.engine import all_gather_cat

            every = all_gather_cat(torch.tensor([max(res) if res else -1.0], dtype=torch.float64), self.engine.world)
            res = [float(r) for r in every if r >= 0]
        if res:
            out["endpoint_residual"] = max(res)
        return out

    def step(self) -> dict:
        from megaloop.post.engine import all_gather_cat

        cfg = self.cfg
        t0 = time.perf_counter()
        examples = self.task.sample(cfg.prompts_per_step, random.Random(f"{cfg.seed}:{self.step_no}"))
        rows = self.local_rows()
        gens = [row_generator(cfg.seed, self.step_no, j) for j in rows]
        counts = getattr(self.task, "run_counts", None)
        before = counts() if counts else (0, 0)
        batches = rollout(self.model, self.tokenizer, self.task, examples, cfg, rows=rows, row_generators=gens)
        t_roll = time.perf_counter() - t0
        local_r = torch.zeros(len(rows))
        local_len = torch.zeros(len(rows))
        for b in batches:
            idx = torch.tensor(b.rows) - rows[0]
            local_r[idx] = b.rewards
            local_len[idx] = b.mask.sum(1).cpu().float()
        rewards = all_gather_cat(local_r, self.engine.world)
        lengths = all_gather_cat(local_len, self.engine.world)
        groups = torch.arange(rewards.numel()) // cfg.group_size
        adv = group_advantages(rewards, groups, cfg.scale_rewards)
        for b in batches:
            b.advantages = adv[torch.tensor(b.rows)].to(b.advantages.device)
        out = {"step": self.step_no, "arm": cfg.arm, "reward_mean": float(rewards.mean()),
               "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
               "completion_len": float(lengths.mean()), "rollout_s": t_roll}
        if getattr(self.task, "isolation", None):  # code-execution rewards: how completions were run
            out["reward_isolation"] = self.task.isolation
        if counts:  # runs killed at the sandbox's wall limit score 0: on a loaded host that is the load, not the code
            from megaloop.post.engine import all_reduce_sum

            after = counts()
            runs, hits = all_reduce_sum([after[0] - before[0], after[1] - before[1]], self.engine.world)
            out["reward_timeouts"] = int(hits)
            if hits and self.log and not self._warned_timeouts:
                self._warned_timeouts = True
                self.log(f"warning: {int(hits)} of {int(runs)} sandboxed runs at step {self.step_no} were killed at the "
                         f"{self.task.config.limits.timeout_s} s wall-clock limit and scored 0; on a loaded host a "
                         "correct program can time out, so rewards depend on the load and --reward-workers "
                         "(each step's count: reward_timeouts in metrics.jsonl)")
        out.update(self.update(batches))
        first = next(b for b in batches if b.rows)
        out["sample"] = {"prompt": first.examples[0].prompt, "completion": first.completions[0]}
        self.last_batches = batches
        self.step_no += 1
        return out

    def save(self, directory: str | Path) -> None:
        """Checkpoint (engine state + step + training seconds) under ``directory/step{N:06d}``, its sidecar
        ``rl_run.json`` (:mod:`megaloop.post.runs`: readable before a model loads) written first by rank 0,
        so ``latest`` never names a step without one (a kill between the two lost it for good)."""
        from megaloop.post.runs import RL_SIDECAR, save_checkpoint, sidecar_fields

        state = {"step": self.step_no, "config": config_dict(self.cfg), "meta": self.meta,
                 "seconds": self.seconds}
        save_checkpoint(self.engine, directory, f"step{self.step_no:06d}", state, RL_SIDECAR,
                        sidecar_fields(state, "megaloop rl", self.engine, **self.record))

    def load(self, directory: str | Path, tag: str | None = None) -> bool:
        """Resume from the latest (or ``tag``) checkpoint in ``directory``; False if there is none.
        :class:`~megaloop.config_utils.ConfigError` when the checkpoint was trained with another
        setting that changes the training (:func:`refuse_changes`; ``steps`` may grow)."""
        client = self.engine.load(directory, tag)
        if client is None:
            return False
        refuse_changes({**(client.get("config") or {}), **(client.get("meta") or {})},
                       {**config_dict(self.cfg), **self.meta}, f"the checkpoint in {directory}")
        self.step_no = int(client["step"])
        self.seconds = float(client.get("seconds") or 0.0)
        self._bind()
        return True

    def train(self, steps: int | None = None, metrics_path: str | Path | None = None,
              save_dir: str | Path | None = None, save_every: int = 0, stop=None,
              stop_dir: str | Path | None = None) -> list[dict]:
        """Run until ``steps`` (default ``cfg.steps``) steps are done in total; checkpoint every
        ``save_every`` steps and at the end when ``save_dir`` is given.

        ``stop``: a :class:`megaloop.runtime.stop.SignalStop`, asked after every step but the last (a
        collective: every rank asks at the same steps); when some rank received a signal the run
        checkpoints into ``stop_dir`` (default ``save_dir``; neither: no checkpoint) unless this
        step was just saved, and returns early with :attr:`stop_signal` set (0 otherwise) and
        :attr:`stop_saved` telling whether a checkpoint of this step exists."""
        history = []
        total = steps if steps is not None else self.cfg.steps
        self.stop_signal, self.stop_saved = 0, False
        saved_at = None
        f = open(metrics_path, "a") if metrics_path else None
        base, t0 = self.seconds, time.perf_counter()
        try:
            while self.step_no < total:
                rec = self.step()
                history.append(rec)
                self.seconds = base + time.perf_counter() - t0
                if f:  # before the save, as train and distill-prefill do: a kill right after a save lost
                    f.write(json.dumps(rec, default=str) + "\n")  # the step's line for good (a resume
                    f.flush()  # cuts a line past its checkpoint)
                if save_dir is not None and (self.step_no == total or (save_every and self.step_no % save_every == 0)):
                    self.save(save_dir)
                    saved_at = self.step_no
                if self.log and (rec["step"] % self.cfg.log_every == 0):
                    gn = rec["grad_norm"]
                    self.log(f"step {rec['step']:4d} reward={rec['reward_mean']:.3f}±{rec['reward_std']:.3f} "
                             f"len={rec['completion_len']:.1f} loss={rec['loss']:+.4f} "
                             f"grad_norm={'-' if gn is None else f'{gn:.3g}'} rollout={rec['rollout_s']:.2f}s "
                             f"update={rec['update_s']:.2f}s")
                # after the step's save and record, so a signal during them costs no further step
                sig = stop.agreed() if stop is not None and self.step_no < total else 0
                if sig:
                    target = stop_dir if stop_dir is not None else save_dir
                    if target is not None and saved_at != self.step_no:
                        self.save(target)
                        saved_at = self.step_no
                    self.stop_signal, self.stop_saved = sig, saved_at == self.step_no
                    break
        finally:
            if f:
                f.close()
        return history


def train(model, tokenizer: TextTokenizer, task: Task, cfg: GRPOConfig, *, metrics_path=None,
          log: Callable[[str], None] | None = print) -> list[dict]:
    """Run ``cfg.steps`` GRPO steps in place on ``model``; returns the per-step records."""
    return GRPOTrainer(model, tokenizer, task, cfg, log=log).train(metrics_path=metrics_path)


def config_dict(cfg: GRPOConfig) -> dict:
    d = asdict(cfg)
    d["betas"] = list(cfg.betas)
    return d


# settings a resumed run may change: the number of steps (how a run is extended) and the log cadence
RESUME_FREE = ("steps", "log_every")
# the megaloop rl flag of each stored setting, for the messages
FLAGS = {"prompts_per_step": "--prompts", "scale_rewards": "--no-scale-rewards", "betas": "betas"}


# settings identified by their content: the fingerprint recorded beside each (SHA-256 of the file read;
# "bytes" for the byte tokenizer; the model's: of its weights, post.distill.student_lm.weights_digest).
# When both runs recorded one, it decides (with the task's kind), not the path
FINGERPRINTS = {"task": "task_sha256", "tokenizer": "tokenizer_sha256", "model": "model_digest"}


def resume_changes(old: dict, new: dict) -> list[str]:
    """``"--flag old → new"`` for each training setting that differs between a checkpoint's stored
    settings ``old`` and this run's ``new`` (keys missing from ``old``, older checkpoints, are not compared;
    a ``task`` recorded without a fingerprint, as typed, has its file resolved from the current folder; a
    setting ``old`` fingerprinted whose fingerprint ``new`` does not hold yet is left to a later call)."""
    from megaloop.post.rl.tasks import task_spec

    def norm(v):
        return list(v) if isinstance(v, tuple) else v

    def shown(record: dict, key: str) -> str:  # the fingerprints where both sides have one (they decided)
        fp = record.get(FINGERPRINTS[key]) if key in FINGERPRINTS and old.get(FINGERPRINTS[key]) \
            and new.get(FINGERPRINTS[key]) else None
        what = "weights sha256" if key == "model" else "sha256"
        return f"{record[key]!r}" + (f" ({what} {fp[:12]})" if fp and fp != record[key] else "")

    out = []
    for key, value in new.items():
        if key in RESUME_FREE or key in FINGERPRINTS.values() or key not in old:
            continue
        fp = FINGERPRINTS.get(key)
        if fp and old.get(fp) and fp not in new:  # this run's fingerprint not known yet (the model before it
            continue  # loads): decided by content once it is, so a moved --model with the same weights resumes
        if fp and old.get(fp) and new.get(fp):  # the same content (and task kind) wherever it lies
            if old[fp] == new[fp] and (key != "task" or old[key].partition(":")[0] == value.partition(":")[0]):
                continue
        else:
            was = task_spec(old[key]) if key == "task" and isinstance(old[key], str) and fp not in old else old[key]
            if norm(was) == norm(value):
                continue
            if isinstance(was, (int, float)) and isinstance(value, (int, float)) \
                    and not isinstance(value, bool) and float(was) == float(value):
                continue
        flag = FLAGS.get(key, "--" + key.replace("_", "-"))
        out.append(f"{flag} {shown(old, key)} → {shown(new, key)}")
    return out


def refuse_changes(old: dict, new: dict, checkpoint: str) -> None:
    """Refuse (:class:`~megaloop.config_utils.ConfigError`, one line) a ``--resume`` whose settings
    ``new`` change the training of ``checkpoint`` (its stored ``old``; :func:`resume_changes`);
    ``checkpoint`` names it in the message (``"the checkpoint RUN/checkpoints/step000004"``)."""
    from megaloop.config_utils import ConfigError

    changes = resume_changes(old, new)
    if changes:
        raise ConfigError(f"--resume: {checkpoint} was trained with other settings: " + "; ".join(changes)
                          + " (only --steps may change on --resume; use a new --out or --overwrite to train "
                          "with these)")


__all__ = ["GRPOConfig", "GRPOTrainer", "RolloutBatch", "completion_logprobs", "config_dict", "refuse_changes",
           "resume_changes", "generate_with_endpoints", "group_advantages", "rollout", "surrogate_loss", "train"]
