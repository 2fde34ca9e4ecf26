"""GRPO-style policy gradient for looped LMs with endpoint reuse (SPEC §9).

One step: sample ``prompts_per_step`` prompts, ``group_size`` completions each, with the HF model's
KV cache (``terminal`` by default, depth ``R`` for prefill and decode) while saving every token's
endpoint state ``z^R`` (the state after the last recurrence: ``hidden_states[-2]`` of each
forward); score completions exactly with the task's :class:`~megaloop.rl.tasks.RewardFn`;
group-normalise the rewards into advantages ``A_i = (r_i − mean_g r) / (std_g r + ε)``; and take
one optimizer step on the surrogate

    L = −(1/n) Σ_i A_i · (1/|o_i|) Σ_t log π(o_{i,t} | ·)      (``loss_norm="sequence"``)
    (or −(1/Σ|o_i|) Σ_i Σ_t A_i log π(...) with ``loss_norm="token"``), + ``kl_coef`` · k3-KL to a
    frozen reference (off by default: KL-free).

The update is on-policy (one optimizer step per rollout batch, so the PPO ratio is 1 and needs
no clipping). Its gradient comes from one of three arms (:mod:`megaloop.rl.reuse`):

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
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from megaloop.rl.parts import HFLoopedParts
from megaloop.rl.reuse import ARMS, backward
from megaloop.rl.tasks import Example, Task, TextTokenizer


@dataclass
class GRPOConfig:
    arm: str = "reuse"  # reuse | recompute | bptt
    num_recurrences: int = 5  # R: rollout prefill/decode depth and the recompute/bptt depth
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
        if self.group_size < 2:
            raise ValueError("group_size must be >= 2 (advantages are normalised within a group)")
        if self.num_recurrences < 1 or self.neumann_b < 1 or self.max_new_tokens < 1:
            raise ValueError("num_recurrences, neumann_b and max_new_tokens must be >= 1")


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


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator) -> torch.Tensor:
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.no_grad()
def generate_with_endpoints(model, prompt_ids: torch.Tensor, *, max_new_tokens: int, num_recurrences: int,
                            eos_id: int | None, vocab_limit: int | None = None, temperature: float = 1.0,
                            top_k: int | None = None, cache_mode: str = "terminal",
                            generator: torch.Generator | None = None):
    """Sample completions with the KV cache, saving each fed token's endpoint ``z^R``.

    Returns ``(completion [B, T], mask [B, T], endpoints [B, P+T-1, d])``; ``T ≤ max_new_tokens``
    (stops early once every row has emitted EOS). ``vocab_limit`` masks padded vocab rows."""
    gen = generator or torch.Generator().manual_seed(0)
    cache = model.new_cache(cache_mode)
    out = model(prompt_ids, past_key_values=cache, num_recurrences=num_recurrences, output_hidden_states=True,
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
        out = model(tok[:, None], past_key_values=cache, num_recurrences=num_recurrences,
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
            generator: torch.Generator) -> list[RolloutBatch]:
    """Generate ``group_size`` completions per example, score them, return batches by prompt length."""
    device = next(model.parameters()).device
    encoded = [tokenizer.encode(ex.prompt) for ex in examples]
    if any(len(p) == 0 for p in encoded):
        raise ValueError("empty prompt")
    vocab_limit = getattr(model.config, "tokenizer_vocab_size", None)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(encoded):
        by_len.setdefault(len(p), []).append(i)
    batches = []
    for plen, idx in sorted(by_len.items()):
        rows = [i for i in idx for _ in range(cfg.group_size)]
        prompt = torch.tensor([encoded[i] for i in rows], dtype=torch.long, device=device)
        comp, mask, ends = generate_with_endpoints(
            model, prompt, max_new_tokens=cfg.max_new_tokens, num_recurrences=cfg.num_recurrences,
            eos_id=tokenizer.eos_id, vocab_limit=vocab_limit, temperature=cfg.temperature, top_k=cfg.top_k,
            cache_mode=cfg.cache_mode, generator=generator)
        texts, rewards = [], []
        for row, i in enumerate(rows):
            n = int(mask[row].sum())
            toks = [t for t in comp[row, :n].tolist() if t != tokenizer.eos_id]
            text = tokenizer.decode(toks)
            texts.append(text)
            rewards.append(float(task.reward(examples[i], text)))
        r = torch.tensor(rewards, dtype=torch.float32)
        adv = group_advantages(r, torch.tensor(rows), cfg.scale_rewards)
        batches.append(RolloutBatch(ids=torch.cat([prompt, comp], 1), prompt_len=plen, mask=mask.to(device),
                                    endpoints=ends, rewards=r, advantages=adv.to(device), groups=rows,
                                    completions=texts, examples=[examples[i] for i in rows]))
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
    def __init__(self, model, tokenizer: TextTokenizer, task: Task, cfg: GRPOConfig,
                 log: Callable[[str], None] | None = print):
        self.model, self.tokenizer, self.task, self.cfg = model.eval(), tokenizer, task, cfg
        self.parts = HFLoopedParts(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.ref = None
        if cfg.kl_coef > 0:
            self.ref = copy.deepcopy(model).eval().requires_grad_(False)
        self.rng = random.Random(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.log = log
        self.step_no = 0

    @torch.no_grad()
    def _ref_logprobs(self, batch: RolloutBatch) -> torch.Tensor | None:
        if self.ref is None:
            return None
        logits = self.ref(batch.ids[:, :-1], use_cache=False, num_recurrences=self.cfg.num_recurrences).logits
        return completion_logprobs(logits, batch)

    def update(self, batches: list[RolloutBatch]) -> dict:
        """One optimizer step over the rollout batches with the configured arm."""
        cfg = self.cfg
        self.opt.zero_grad(set_to_none=True)
        n_seqs = sum(b.ids.shape[0] for b in batches)
        n_tokens = int(sum(float(b.mask.sum()) for b in batches))
        stats, skipped, t0 = [], 0, time.perf_counter()
        for batch in batches:
            if cfg.kl_coef == 0 and bool((batch.advantages == 0).all()):
                skipped += 1  # zero gradient: every group of this batch has equal rewards
                continue
            loss_fn = surrogate_loss(batch, cfg, n_seqs, n_tokens, self._ref_logprobs(batch))
            inputs = batch.ids[:, :-1]
            stats.append(backward(cfg.arm, self.parts, inputs, loss_fn, depth=cfg.num_recurrences,
                                  b=cfg.neumann_b, z_end=batch.endpoints, window=cfg.bptt_window))
        grad_norm = None
        if stats:
            if cfg.clip_grad:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.clip_grad))
            else:
                grad_norm = float(torch.linalg.vector_norm(torch.stack(
                    [p.grad.norm() for p in self.params if p.grad is not None])))
            self.opt.step()
        out = {"update_s": time.perf_counter() - t0, "loss": sum(s.loss for s in stats),
               "grad_norm": grad_norm, "batches": len(batches), "skipped_batches": skipped}
        res = [s.residual for s in stats if s.residual is not None]
        if res:
            out["endpoint_residual"] = max(res)
        return out

    def step(self) -> dict:
        cfg = self.cfg
        t0 = time.perf_counter()
        examples = self.task.sample(cfg.prompts_per_step, self.rng)
        batches = rollout(self.model, self.tokenizer, self.task, examples, cfg, self.gen)
        t_roll = time.perf_counter() - t0
        rewards = torch.cat([b.rewards for b in batches])
        lengths = torch.cat([b.mask.sum(1).cpu() for b in batches])
        out = {"step": self.step_no, "arm": cfg.arm, "reward_mean": float(rewards.mean()),
               "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
               "completion_len": float(lengths.mean()), "rollout_s": t_roll}
        out.update(self.update(batches))
        out["sample"] = {"prompt": examples[0].prompt, "completion": batches[0].completions[0]}
        self.last_batches = batches
        self.step_no += 1
        return out

    def train(self, steps: int | None = None, metrics_path: str | Path | None = None) -> list[dict]:
        history = []
        f = open(metrics_path, "a") if metrics_path else None
        try:
            for _ in range(steps if steps is not None else self.cfg.steps):
                rec = self.step()
                history.append(rec)
                if f:
                    f.write(json.dumps(rec, default=str) + "\n")
                    f.flush()
                if self.log and (rec["step"] % self.cfg.log_every == 0):
                    gn = rec["grad_norm"]
                    self.log(f"step {rec['step']:4d} reward={rec['reward_mean']:.3f}±{rec['reward_std']:.3f} "
                             f"len={rec['completion_len']:.1f} loss={rec['loss']:+.4f} "
                             f"grad_norm={'-' if gn is None else f'{gn:.3g}'} rollout={rec['rollout_s']:.2f}s "
                             f"update={rec['update_s']:.2f}s")
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


__all__ = ["GRPOConfig", "GRPOTrainer", "RolloutBatch", "completion_logprobs", "config_dict",
           "generate_with_endpoints", "group_advantages", "rollout", "surrogate_loss", "train"]
