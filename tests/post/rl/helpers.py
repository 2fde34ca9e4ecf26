"""Shared by tests/rl and tests/distill: a tiny byte-level looped HF model trained briefly on the
embedded corpus (in process, TBPTT b=2 with sampled depths, so its endpoints settle), cached once
per pytest session."""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

TEACHER_STEPS = 120


def tiny_config(**overrides):
    from megaloop.hf.configuration_megaloop import MegaloopConfig

    kw = dict(vocab_size=264, tokenizer_vocab_size=257, hidden_size=64, num_attention_heads=4,
              intermediate_size=128, n_prelude=1, n_core=2, n_coda=1, injection="parcae_nonorm",
              state_init_std=0.5, num_recurrences=5, eos_token_id=256, max_position_embeddings=64)
    kw.update(overrides)
    return MegaloopConfig(**kw)


def corpus_ids() -> torch.Tensor:
    from megaloop.data.stdlib_corpus import topic_documents  # English prose, read in ms

    text = "\n\n".join(d.text for d in topic_documents()[:200])
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def train_tiny(steps: int = TEACHER_STEPS, seed: int = 0, seq: int = 40, batch: int = 12, lr: float = 3e-3):
    """A tiny looped model trained ``steps`` AdamW steps (CE, depth ~ U{2..6}, TBPTT window 2)."""
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM
    from megaloop.post.rl.parts import HFLoopedParts
    from megaloop.post.rl.reuse import bptt_backward

    torch.manual_seed(seed)
    model = MegaloopForCausalLM(tiny_config()).train()
    parts = HFLoopedParts(model)
    data = corpus_ids()
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    for step in range(steps):
        starts = [rng.randrange(0, data.numel() - seq - 1) for _ in range(batch)]
        win = torch.stack([data[s:s + seq + 1] for s in starts])
        x, y = win[:, :-1], win[:, 1:]
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * (1 - step / steps))

        def loss_fn(logits):
            return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

        opt.zero_grad(set_to_none=True)
        st = bptt_backward(parts, x, rng.randint(2, 6), loss_fn, bptt_window=2)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(st.loss)
    return model.eval(), losses


def cached_teacher(base: Path):
    """The trained tiny model, trained once per session and saved under ``base``."""
    from megaloop.hf.modeling_megaloop import MegaloopForCausalLM

    out = base / "tiny_teacher"
    if not (out / "model.safetensors").is_file():
        t0 = time.time()
        model, losses = train_tiny()
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out), safe_serialization=True)
        (out / "megaloop_tokenizer.json").write_text('{"spec": "bytes"}')
        (out / "train_log.txt").write_text(f"{losses[0]:.4f} -> {losses[-1]:.4f} in {time.time() - t0:.1f}s\n")
    return MegaloopForCausalLM.from_pretrained(str(out)).eval(), out
