"""Numerical checks of a conversion: the HF model against the native one (:func:`check_conversion`,
``max|Δlogit| / max(1, max|native logit|)`` ≤ :data:`TOLERANCE`), and a saved folder reloaded through
``AutoModelForCausalLM`` against the model it was saved from (:func:`check_reload`)."""

from __future__ import annotations

from pathlib import Path

import torch

from megaloop.hf.errors import ConversionError
from megaloop.hf.modeling_megaloop import MegaloopForCausalLM

TOLERANCE = 1e-4


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def compare_logits(native, hf_model, *, depth: int, vocab: int, seq_len: int, num_seqs: int = 2,
                   seed: int = 0) -> dict[str, float]:
    """Max abs / rel logit error of HF vs native on random sequences (both in their current dtype)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (num_seqs, seq_len), generator=g)
    ref = native(ids.to(_device_of(native)), depth=depth).float().cpu()
    got = hf_model(input_ids=ids.to(_device_of(hf_model)), use_cache=False,
                   num_recurrences=depth).logits.float().cpu()
    if ref.shape != got.shape:
        raise ConversionError(f"validation: logits shape {tuple(got.shape)} (HF) != {tuple(ref.shape)} (native)")
    if not torch.isfinite(ref).all():  # a diverged checkpoint: not a conversion fault (it read "error nan")
        raise ConversionError(f"validation: the checkpoint's own logits are not finite at depth {depth} (a "
                              "diverged checkpoint? see its metrics.jsonl): there is no working model to load")
    diff = (ref - got).abs().max().item()
    scale = ref.abs().max().item()
    return {"max_abs": diff, "max_rel": diff / max(scale, 1e-30), "error": diff / max(1.0, scale),
            "logit_scale": scale, "depth": depth, "seq_len": seq_len, "num_seqs": num_seqs}


def check_conversion(native, hf_model, *, seq_len: int, num_seqs: int = 2) -> dict:
    """:func:`compare_logits` of ``num_seqs`` random ``seq_len``-token sequences (of the real
    vocabulary) at the HF model's default depth; the result, or :class:`ConversionError` naming
    both errors when ``error`` exceeds :data:`TOLERANCE`. One forward of each model (FP32, eval)."""
    depth, vocab = hf_model.config.num_recurrences, hf_model.config.tokenizer_vocab_size
    res = compare_logits(native, hf_model, depth=depth, vocab=vocab, seq_len=seq_len, num_seqs=num_seqs)
    res["summary"] = (f"validation (FP32, eval, depth {depth}, {num_seqs}x{seq_len} tokens): max abs logit error "
                      f"{res['max_abs']:.3e}, max rel {res['max_rel']:.3e} (logit scale {res['logit_scale']:.3g}; "
                      f"tolerance {TOLERANCE:g} on max_abs/max(1, scale))")
    if not res["error"] <= TOLERANCE:
        raise ConversionError(f"HF model does not reproduce the native model: {res['summary']}")
    return res


@torch.no_grad()
def check_reload(model: MegaloopForCausalLM, out: Path, depth: int, vocab: int) -> dict:
    """Load ``out`` through AutoModelForCausalLM(trust_remote_code) and compare with the saved model."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    ref = model.float()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, min(16, model.config.max_position_embeddings)), generator=g)
    a = ref(input_ids=ids, use_cache=False, num_recurrences=depth).logits
    b = loaded(input_ids=ids, use_cache=False, num_recurrences=depth).logits
    diff = (a - b).abs().max().item()
    if not diff <= 1e-5 * max(1.0, a.abs().max().item()):
        raise ConversionError(f"reloaded folder {out} differs from the converted model: max abs {diff:.3e}")
    return {"max_abs": diff, "class": type(loaded).__module__ + "." + type(loaded).__name__}
