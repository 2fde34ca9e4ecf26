"""Student prefill wherever a prefill happens: :class:`StudentPrefillLM` wraps a teacher
``MegaloopForCausalLM`` so that every *prefill* call — a multi-token forward into an empty
``terminal`` cache — runs :func:`~megaloop.post.distill.prefill_student.student_prefill` (prelude →
student → one teacher recurrence → coda), and every other call (decoding, scoring a chunk through
the filled cache, cache-free forwards) goes to the teacher unchanged. Attribute access falls
through to the teacher, so the wrapper drops into :class:`megaloop.inference.engine.InferenceEngine`
(``engine.model``) and hence ``megaloop eval ppl|harness`` and ``megaloop generate``:

    model, source = load_model(path, student="students/S")   # megaloop.hf.load; what --student DIR does
    attach_student(engine, "students/S")                      # or onto an existing engine

The prefill's requested depth is ignored (the student replaces the R-recurrence prefill);
``prefills`` counts the calls served by the student. Left-padded batches take the teacher's
padding mask and positions (the student's layers attend like the core's).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch
from torch import nn

from megaloop.config_utils import ConfigError

_SHAPE_KEYS = ("hidden_size", "num_attention_heads", "n_prelude", "n_core", "n_coda", "injection", "vocab_size")


@torch.no_grad()
def weights_digest(model: nn.Module) -> str:
    """SHA-256 of ``model``'s state dict (names and values rounded to BF16, so an FP32 teacher and
    the same weights loaded in BF16 or exported as BF16 agree): which teacher a student was fitted to."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if not torch.is_tensor(t) or not t.is_floating_point():
            continue
        h.update(name.encode())
        h.update(t.detach().to(device="cpu", dtype=torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()


class StudentPrefillLM(nn.Module):
    def __init__(self, teacher: nn.Module, student: nn.Module):
        super().__init__()
        self.teacher = teacher
        self.student = student
        self.prefills = 0

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("teacher"), name)

    @staticmethod
    def _is_prefill(input_ids, cache) -> bool:
        return (input_ids is not None and cache is not None and hasattr(cache, "get_seq_length")
                and input_ids.shape[1] > 1 and cache.get_seq_length() == 0)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, num_recurrences=None, logits_to_keep=0, cache=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        from megaloop.post.distill.prefill_student import student_prefill

        past = past_key_values if past_key_values is not None else cache
        if not self._is_prefill(input_ids, past):
            return self.teacher(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                past_key_values=past, use_cache=use_cache, num_recurrences=num_recurrences,
                                logits_to_keep=logits_to_keep, **kwargs)
        if getattr(past, "mode", "terminal") != "terminal":
            raise ConfigError("--student: student prefill fills a terminal cache; use --cache terminal")
        if not isinstance(logits_to_keep, int):
            raise ValueError("student prefill: logits_to_keep must be an int")
        logits, past = student_prefill(self.teacher, self.student, input_ids, cache=past,
                                       logits_to_keep=logits_to_keep, attention_mask=attention_mask,
                                       position_ids=position_ids)
        self.prefills += 1
        return CausalLMOutputWithPast(logits=logits, past_key_values=past)


def load_student_for(model: nn.Module, path: str | Path) -> nn.Module:
    """The student in ``path`` on ``model``'s device/dtype, checked against ``model``'s shape."""
    from megaloop.post.distill.prefill_student import load_student

    path = Path(path)
    if not (path / "student.json").is_file():
        raise ConfigError(f"--student: {path} has no student.json (write one with megaloop distill-prefill)")
    try:
        p = next(model.parameters())
        student, info = load_student(path, device=p.device, dtype=p.dtype)
    except (ValueError, KeyError, RuntimeError, OSError) as err:
        raise ConfigError(f"--student: {path}: {err}") from None
    tc = info["teacher_config"]
    for key in _SHAPE_KEYS:
        if key in tc and getattr(model.config, key, None) != tc[key]:
            raise ConfigError(f"--student: {path} was distilled from a model with {key}={tc[key]!r}, "
                              f"this one has {getattr(model.config, key, None)!r}")
    if p.dtype == torch.float16:  # FP16's rounding (and underflow) is not BF16's: the digest cannot match
        if info.get("teacher_digest"):
            print(f"note: --student {path}: under --dtype fp16 megaloop cannot check that it was distilled from these "
                  "weights (it warned that it was not, even for its own teacher); fp32 or bf16 check it", file=sys.stderr)
    elif info.get("teacher_digest") and info["teacher_digest"] != weights_digest(model):
        print(f"warning: --student {path} was distilled from other weights of the same shape "
              f"({info.get('teacher', 'teacher not recorded')}); its prefill approximates that model's recurrence, "
              f"not this one's (distill a student from this checkpoint for a faithful prefill)", file=sys.stderr)
    return student


def with_student(model: nn.Module, path: str | Path) -> StudentPrefillLM:
    return StudentPrefillLM(model, load_student_for(model, path))


def attach_student(engine, path: str | Path) -> StudentPrefillLM:
    """Make ``engine`` (an :class:`~megaloop.inference.engine.InferenceEngine`) prefill through the student."""
    if isinstance(engine.model, StudentPrefillLM):
        raise ConfigError("--student: this engine already prefills through a student")
    engine.model = with_student(engine.model, path).eval()
    return engine.model
