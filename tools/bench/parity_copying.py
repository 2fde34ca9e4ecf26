"""The in-context copying probe (:mod:`megaloop.eval.copying`) in the parity harness.

Every training result gets ``copying``: ``{R: {loss_first, loss_repeat, copy_gain, ...}}`` at the
depths :data:`DEPTHS`, measured on the same probe sequences for megaloop and a reference (16
sequences of 64 random ids repeated once: 128 tokens, the protocol's seq_len). ``--add-copying RUN
RESULT`` measures it afterwards from a megaloop run directory's final checkpoint and writes it into
that result (atomically); the references keep no checkpoint, so theirs is measured only at training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from megaloop.eval.copying import copy_probe

DEPTHS = (1, 5)
# the embedded tokenizer's special tokens (<|endoftext|>, <|bos|>, <|pad|>): left out of the random
# sequences so that no probe sequence carries a document boundary.
SPECIAL_IDS = (0, 1, 2)


def probe_depths(logits_at: Callable[[torch.Tensor, int], torch.Tensor], vocab: int, seq_len: int,
                 seed: int) -> dict:
    """``{str(R): copy_probe(...)}`` for R in :data:`DEPTHS`; ``logits_at(ids, R)`` gives the logits at
    depth R. ``seed`` re-seeds torch before each depth (a random h⁰ is drawn from torch's RNG)."""
    out = {}
    for r in DEPTHS:
        torch.manual_seed(seed)
        out[str(r)] = copy_probe(lambda ids: logits_at(ids, r), vocab, half_len=seq_len // 2,
                                exclude=SPECIAL_IDS)
    return out


def megaloop_copying(hf, seq_len: int, seed: int) -> dict:
    """The probe on a megaloop HF model (eval mode, its own h⁰ init)."""
    hf = hf.eval()
    vocab = getattr(hf.config, "tokenizer_vocab_size", None) or hf.config.vocab_size  # not the padding rows
    return probe_depths(lambda ids, r: hf(input_ids=ids, num_recurrences=r).logits, vocab, seq_len, seed)


def add_copying(run_dir: Path, result: Path) -> dict:
    """Measure the probe on ``run_dir``'s final checkpoint and write it into ``result`` (a
    ``parity.py`` training result of that run: the labels must match)."""
    from megaloop.hf.load import load_model
    from megaloop.runtime.files import atomic_write_json

    res = json.loads(result.read_text())
    if "losses" not in res or res.get("system") != "megaloop":
        raise SystemExit(f"--add-copying: {result} is not a megaloop training result of parity.py")
    if Path(run_dir).name != f"run_{res['label']}":
        raise SystemExit(f"--add-copying: {run_dir} is not the run of {result} (label {res['label']!r} "
                         f"trains in run_{res['label']})")
    hf, source = load_model(run_dir)
    if source.get("step") != res["steps"]:
        raise SystemExit(f"--add-copying: {run_dir}'s latest checkpoint is step {source.get('step')}, "
                         f"the result trained {res['steps']} steps")
    res["copying"] = megaloop_copying(hf.float(), res["config"]["seq_len"], res["seed"])
    atomic_write_json(result, res, indent=1, sort_keys=False)
    return res["copying"]


def copying_lines(res: list[dict]) -> list[str]:
    """Report table of the results that carry ``copying``."""
    rows = []
    for r in (r for r in res if r.get("copying")):
        c = r["copying"]
        cells = " | ".join(f"{c[str(d)]['loss_first']:.2f} → {c[str(d)]['loss_repeat']:.2f} "
                           f"(**{c[str(d)]['copy_gain']:.2f}**)" for d in DEPTHS)
        rows.append(f"| {r['label']} | {r['system']} | {r['steps']} | {sum(r['losses'][-10:]) / len(r['losses'][-10:]):.3f} | {cells} |")
    if not rows:
        return []
    half = next(r for r in res if r.get("copying"))["copying"][str(DEPTHS[0])].get("half_len", "n")
    return ["", f"In-context copying (`megaloop.eval.copying`): cross-entropy on {half} random tokens, first "
            "occurrence → repeat, and the copy gain (nats) between them.", "",
            "| run | system | steps | train loss | " + " | ".join(f"R={d}" for d in DEPTHS) + " |",
            "|---" * (4 + len(DEPTHS)) + "|", *rows]
