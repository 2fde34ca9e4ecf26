"""Distilled prefill (SPEC §10): a student ``S_ψ`` predicts the teacher's recurrent endpoint.

From the prelude output ``e = P_θ(x)`` the student predicts ``ẑ = S_ψ(e) ≈ z^R``; prefill then applies
ONE teacher recurrence to ``ẑ`` and the coda, and keeps each physical layer's KV bank in a
*terminal* cache (prelude / core (that one recurrence) / coda: ``n_prelude + n_core + n_coda``
banks per token), so decoding with the teacher at its own depth is unchanged.

Student (**choice**, the paper's "initialised from the teacher's core"): a copy of the teacher's
core layers and injection (``num_layers`` pre-norm layers, default ``n_core``; extra layers
copy the core cyclically), applied once to ``(h⁰, e)`` with ``h⁰`` the teacher's evaluation
state init (``init_state="teacher"``, so at initialisation ``ẑ`` equals the teacher's state
after one recurrence) or zeros. Its layers attend causally over the prompt like the core.

Loss (depth-``R`` targets computed online by the frozen teacher)::

    L = ‖ẑ − z^R‖² / (N d σ_T²) + λ_KL · (1/N) Σ_t KL(p_t ‖ p̂_t)

``σ_T²`` = mean of ``(z^R)²`` over the tokens and coordinates of ``calib_batches`` training batches
(fixed before training); ``p_t`` = teacher next-token distribution at depth ``R``; ``p̂_t`` = frozen
coda + final norm + head applied to ``ẑ``; the KL runs over the tokenizer's vocabulary (padded
head rows excluded).

Files: ``student.safetensors`` (weights) + ``student.json`` (teacher config, student shape,
``depth``, ``sigma2``, ``lambda_kl``, training summary); :func:`save_student` / :func:`load_student`.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from megaloop.post.rl.parts import HFLoopedParts
from megaloop.post.runs import cut_metrics

FORMAT = "megaloop-prefill-student"


class PrefillStudent(nn.Module):
    """``ẑ = exit(layers(inject(h⁰, e)))`` — a standalone copy of the teacher's core block."""

    def __init__(self, config, num_layers: Optional[int] = None, init_state: str = "teacher"):
        super().__init__()
        from megaloop.hf.modeling_megaloop import MegaloopLayer, build_injection

        if not config.looped:
            raise ValueError("a prefill student needs a looped teacher")
        if init_state not in ("teacher", "zero"):
            raise ValueError(f"init_state: 'teacher' or 'zero', got {init_state!r}")
        self.config = copy.deepcopy(config)
        self.num_layers = int(num_layers or config.n_core)
        self.init_state = init_state
        deq = config.injection == "deq_qkv"
        self.injection = build_injection(self.config)
        self.layers = nn.ModuleList([MegaloopLayer(self.config, inject=deq) for _ in range(self.num_layers)])

    @classmethod
    def from_teacher(cls, teacher, num_layers: Optional[int] = None, init_state: str = "teacher",
                     init: str = "teacher", seed: int = 0) -> "PrefillStudent":
        """``init="teacher"``: the core's weights (cyclically); ``"random"``: the teacher's own
        weight initialisation (``_init_weights``, seeded) of the same shape."""
        if init not in ("teacher", "random"):
            raise ValueError(f"student init: 'teacher' or 'random', got {init!r}")
        student = cls(teacher.config, num_layers, init_state)
        if init == "teacher":
            student.copy_block(*teacher.model.recurrent_block())
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                for module in student.modules():
                    if hasattr(teacher, "_init_weights"):
                        teacher._init_weights(module)
                    elif hasattr(module, "reset_parameters"):
                        module.reset_parameters()
        p = next(teacher.parameters())
        return student.to(device=p.device, dtype=p.dtype)

    def copy_block(self, injection: nn.Module, core: nn.ModuleList) -> None:
        """Load the teacher's injection and core layers (cyclically when the student is deeper)."""
        self.injection.load_state_dict(injection.state_dict())
        for i, layer in enumerate(self.layers):
            layer.load_state_dict(core[i % len(core)].state_dict())

    def zero3_external_parameters(self) -> list[nn.Parameter]:
        """Parameters used outside a submodule ``forward`` (the injection's ``prepare``/``exit``):
        ZeRO-3 must gather them for the whole student forward."""
        return list(self.injection.parameters())

    def forward(self, p, h0: torch.Tensor) -> torch.Tensor:
        """``ẑ`` [b, s, d] from ``h⁰`` [b, s, d] over the teacher's pass ``p`` (a
        :class:`~megaloop.hf.modeling_megaloop.LoopedPass`: its ``e``, rotary tables and mask)."""
        return p.step(h0, block=self)[0]


def student_init_state(student, p) -> torch.Tensor:
    """The student's ``h⁰`` on pass ``p``: the teacher's evaluation init, or zeros."""
    return p.init_state(zero=getattr(student, "init_state", "teacher") == "zero")


# ----------------------------------------------------------------------------- loss and training
@dataclass
class DistillConfig:
    depth: int = 5  # teacher depth R of the targets
    lambda_kl: float = 1.0
    steps: int = 500
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    calib_batches: int = 8
    seed: int = 0
    log_every: int = 10
    hidden_loss: bool = True  # the ‖ẑ − z^R‖² / σ_T² term (switch off to train on the KL alone)

    def __post_init__(self) -> None:
        if self.depth < 1 or self.steps < 0 or self.batch_size < 1 or self.seq_len < 2:
            raise ValueError("depth, batch_size must be >= 1, seq_len >= 2 and steps >= 0")
        if self.lambda_kl < 0:
            raise ValueError(f"lambda_kl must be >= 0, got {self.lambda_kl}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every}")
        if self.calib_batches < 1:
            raise ValueError(f"calib_batches must be >= 1, got {self.calib_batches}")
        if not self.hidden_loss and self.lambda_kl == 0:
            raise ValueError("no loss term left: the hidden-state term is off and lambda_kl = 0")


@torch.no_grad()
def teacher_targets(teacher, parts: HFLoopedParts, student, ids: torch.Tensor, depth: int):
    """``(e, h⁰, z^R, teacher logits)`` of the frozen teacher (parallel pass, eval init)."""
    e = parts.encode(ids)
    h0 = student_init_state(student, parts.pass_for(e))
    z = parts.init_state(e)
    for _ in range(depth):
        z = parts.step(z, e)
    return e, h0, z, parts.readout(z)


@torch.no_grad()
def calibrate_sigma2(teacher, batches, depth: int) -> float:
    """σ_T²: mean squared teacher endpoint per coordinate over ``batches`` (FP64 accumulation)."""
    parts = HFLoopedParts(teacher)
    total, count = 0.0, 0
    for ids in batches:
        e = parts.encode(ids)
        z = parts.init_state(e)
        for _ in range(depth):
            z = parts.step(z, e)
        total += float(z.double().pow(2).sum())
        count += z.numel()
    if not count:
        raise ValueError("no calibration batches")
    return total / count


def distill_loss(z_hat: torch.Tensor, z_target: torch.Tensor, logits_hat: torch.Tensor,
                 logits_teacher: torch.Tensor, sigma2: float, lambda_kl: float,
                 vocab: Optional[int] = None, hidden_weight: float = 1.0) -> tuple[torch.Tensor, dict]:
    """SPEC §10 loss ``hidden_weight · hidden + lambda_kl · kl``; returns ``(loss, {"hidden": …,
    "kl": …})`` (per-token means; both terms are reported even when switched off)."""
    n, d = z_hat.numel() // z_hat.shape[-1], z_hat.shape[-1]
    hidden = (z_hat.float() - z_target.float()).pow(2).sum() / (n * d * sigma2)
    if vocab is not None:
        logits_hat, logits_teacher = logits_hat[..., :vocab], logits_teacher[..., :vocab]
    logp = torch.log_softmax(logits_teacher.float(), -1)
    logq = torch.log_softmax(logits_hat.float(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    if hidden_weight and lambda_kl:
        loss = hidden_weight * hidden + lambda_kl * kl
    elif lambda_kl:
        loss = lambda_kl * kl
    else:
        loss = hidden_weight * hidden
    return loss, {"hidden": float(hidden.detach()), "kl": float(kl.detach())}


def _frozen(model: nn.Module):
    flags = [p.requires_grad for p in model.parameters()]

    class _Ctx:
        def __enter__(self):
            model.requires_grad_(False)

        def __exit__(self, *exc):
            for p, f in zip(model.parameters(), flags):
                p.requires_grad_(f)

    return _Ctx()


def student_step_loss(teacher, parts, student, ids, cfg: DistillConfig, sigma2: float, forward=None):
    """Loss of one batch; ``forward`` calls the student (default ``student``; a DeepSpeed engine)."""
    e, h0, z_t, logits_t = teacher_targets(teacher, parts, student, ids, cfg.depth)
    z_hat = (forward or student)(parts.pass_for(e), h0)
    logits_hat = parts.readout(z_hat)
    vocab = getattr(teacher.config, "tokenizer_vocab_size", None)
    return distill_loss(z_hat, z_t, logits_hat, logits_t, sigma2, cfg.lambda_kl, vocab,
                        hidden_weight=1.0 if cfg.hidden_loss else 0.0)


@torch.no_grad()
def evaluate_student(teacher, student, batches, cfg: DistillConfig, sigma2: float) -> dict:
    """Mean loss terms on ``batches`` and agreement of student-prefill vs teacher prefill (next-token
    top-1 match and KL of the prompt logits after the one teacher recurrence)."""
    parts = HFLoopedParts(teacher)
    acc = {"loss": 0.0, "hidden": 0.0, "kl": 0.0, "prefill_top1": 0.0, "prefill_kl": 0.0}
    n = 0
    vocab = getattr(teacher.config, "tokenizer_vocab_size", None)
    with _frozen(teacher):
        for ids in batches:
            loss, terms = student_step_loss(teacher, parts, student, ids, cfg, sigma2)
            e = parts.encode(ids)
            p = parts.pass_for(e)
            z_hat = student(p, student_init_state(student, p))
            lg_s = parts.readout(parts.step(z_hat, e))[..., :vocab]
            lg_t = teacher(ids, use_cache=False, num_recurrences=cfg.depth).logits[..., :vocab]
            lp, lq = torch.log_softmax(lg_t.float(), -1), torch.log_softmax(lg_s.float(), -1)
            acc["loss"] += float(loss)
            acc["hidden"] += terms["hidden"]
            acc["kl"] += terms["kl"]
            acc["prefill_top1"] += float((lg_s.argmax(-1) == lg_t.argmax(-1)).float().mean())
            acc["prefill_kl"] += float((lp.exp() * (lp - lq)).sum(-1).mean())
            n += 1
    return {k: v / max(n, 1) for k, v in acc.items()}


def warmup_steps(cfg: DistillConfig) -> int:
    """The warm-up the schedule uses: ``cfg.warmup``, shortened to ``steps - 1`` on a run not longer than
    it (``megaloop distill-prefill`` refuses an explicit ``--warmup`` >= ``--steps``; only its default
    of 20 is shortened so)."""
    return max(0, min(cfg.warmup, cfg.steps - 1))


def lr_at(cfg: DistillConfig, step: int) -> float:
    """The LR of (0-based) ``step``: linear warm-up to ``lr`` over the first :func:`warmup_steps` steps
    (step ``w - 1`` trains at ``lr``), then cosine decay to ``min_lr_ratio · lr``, reached at the last
    step ``steps - 1``. A pure function of ``(cfg, step)``, so a resumed run trains at the same LRs."""
    w = warmup_steps(cfg)
    peak = max(w - 1, 0)  # the step at lr: the warm-up's last, where the decay starts
    if step < peak:
        return cfg.lr * (step + 1) / w
    frac = min(1.0, (step - peak) / max(cfg.steps - 1 - peak, 1))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def train_student(teacher, student: PrefillStudent, batches: Iterator[torch.Tensor], cfg: DistillConfig, *,
                  sigma2: Optional[float] = None, calib: Optional[list[torch.Tensor]] = None,
                  log: Optional[Callable[[str], None]] = print, metrics_path=None, engine=None,
                  start_step: int = 0, save: Optional[Callable[[int], None]] = None,
                  save_every: int = 0, stop=None, stop_save: Optional[Callable[[int], None]] = None) -> dict:
    """Train ``student`` in place against the frozen ``teacher`` (kept in eval mode, weights untouched).

    ``batches`` yields the *global* batch of token ids [b, s]; under a data-parallel ``engine``
    (:mod:`megaloop.post.engine`) rank ``r`` trains on rows ``[r·b/W, (r+1)·b/W)`` and the engine
    averages the gradients, so the update equals one process on the whole batch. ``start_step``
    (resume) skips that many batches of a fresh stream; ``save(step)`` runs every ``save_every``
    steps and at the end. σ_T² is calibrated on ``calib`` (default: the first
    ``cfg.calib_batches`` batches of the stream) unless given.

    ``stop``: a :class:`megaloop.runtime.stop.SignalStop`, asked after every step but the last (a
    collective: every rank asks at the same steps); when some rank received a signal, ``stop_save``
    (default ``save``; neither: no checkpoint) checkpoints the steps done unless ``save`` just did,
    and training ends there. Returns ``{"sigma2", "history", "step", "stop_signal", "stop_saved"}``
    (``step``: the steps done; ``stop_signal`` 0 unless a signal stopped it; ``stop_saved``: a
    checkpoint of ``step`` exists)."""
    from megaloop.post.engine import PlainEngine

    teacher.eval()
    parts = HFLoopedParts(teacher)
    if sigma2 is None:
        if calib is None:
            calib = [next(batches) for _ in range(cfg.calib_batches)]
        sigma2 = calibrate_sigma2(teacher, calib, cfg.depth)
    engine = engine or PlainEngine(student, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                   clip_grad=cfg.clip_grad)
    if cfg.batch_size % engine.world:
        raise ValueError(f"batch_size {cfg.batch_size} does not split over {engine.world} processes")
    rows = cfg.batch_size // engine.world
    lo = engine.rank * rows
    for _ in range(start_step):
        next(batches)
    history = []
    if metrics_path and start_step:
        cut_metrics(metrics_path, start_step)
    f = open(metrics_path, "a") if metrics_path else None
    t0 = time.perf_counter()
    done, saved_at, stop_signal = start_step, None, 0
    try:
        with _frozen(teacher):
            student.train()
            for step in range(start_step, cfg.steps):
                lr = lr_at(cfg, step)
                engine.set_lr(lr)
                ids = next(batches)[lo:lo + rows]
                loss, terms = student_step_loss(teacher, parts, student, ids, cfg, sigma2, forward=engine.forward)
                engine.backward(loss)
                gn = engine.step()
                if engine.world > 1:
                    from megaloop.post.engine import all_reduce_sum

                    tot = all_reduce_sum([float(loss.detach()), terms["hidden"], terms["kl"]], engine.world)
                    loss_v, terms = tot[0] / engine.world, {"hidden": tot[1] / engine.world, "kl": tot[2] / engine.world}
                else:
                    loss_v = float(loss.detach())
                rec = {"step": step, "loss": loss_v, **terms, "grad_norm": gn, "lr": lr,
                       "seconds": time.perf_counter() - t0}
                history.append(rec)
                if f:  # flushed at once: a killed run keeps every step it finished (and all before a checkpoint)
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                if log and (step % cfg.log_every == 0 or step == cfg.steps - 1):
                    log(f"step {step:5d} loss={rec['loss']:.4f} hidden={terms['hidden']:.4f} kl={terms['kl']:.4f}")
                done = step + 1
                if save is not None and (done == cfg.steps or (save_every and done % save_every == 0)):
                    save(done)
                    saved_at = done
                # after the step's record and save, so a signal during them costs no further step
                stop_signal = stop.agreed() if stop is not None and done < cfg.steps else 0
                if stop_signal:
                    target = stop_save if stop_save is not None else save
                    if target is not None and saved_at != done:
                        target(done)
                        saved_at = done
                    break
    finally:
        student.eval()
        if f:
            f.close()
    return {"sigma2": sigma2, "history": history, "step": done, "stop_signal": stop_signal,
            "stop_saved": saved_at == done}


# ----------------------------------------------------------------------------- prefill and decode
@torch.no_grad()
def student_prefill(model, student, input_ids: torch.Tensor, cache=None, logits_to_keep: int = 1,
                    attention_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None):
    """Prefill ``input_ids`` into a terminal cache through the student; returns ``(logits, cache)``.

    prelude → ``ẑ = student(e)`` → one teacher recurrence (its core KV kept as the terminal banks)
    → coda → final norm → head (last ``logits_to_keep`` positions; 0 = all). The cache must be
    empty (a fresh ``model.new_cache("terminal")`` by default); decode afterwards with
    ``model(next_ids, past_key_values=cache)`` at any depth. ``attention_mask`` [b, s] (0 = left
    padding) and ``position_ids`` [b, s] follow the teacher's own forward."""
    if cache is None:
        cache = model.new_cache("terminal")
    if cache.mode != "terminal":
        raise ValueError("student prefill fills a terminal cache (one KV bank per physical layer)")
    if cache.get_seq_length():
        raise ValueError("student prefill needs an empty cache (the student has no KV of earlier tokens)")
    p = model.begin(input_ids, positions=position_ids, attention_mask=attention_mask)
    h, core_kv = p.step(student(p, student_init_state(student, p)))
    logits, coda_kv = p.readout(h, keep=logits_to_keep)
    new = {("prelude", i, 0): kv for i, kv in enumerate(p.prelude_kv)}
    new.update({("core", i, 0): kv for i, kv in enumerate(core_kv)})
    new.update({("coda", i, 0): kv for i, kv in enumerate(coda_kv)})
    cache.batch_size = input_ids.shape[0]
    cache.commit(new, 1, input_ids.shape[1])
    return logits, cache


@torch.no_grad()
def generate(model, student, input_ids: torch.Tensor, max_new_tokens: int, *,
             decode_recurrences: Optional[int] = None, eos_id: Optional[int] = None):
    """Greedy decoding: student prefill, then the teacher decodes with the terminal cache.
    Returns ``(ids [b, s + n], cache)``."""
    logits, cache = student_prefill(model, student, input_ids)
    vocab = getattr(model.config, "tokenizer_vocab_size", None) or logits.shape[-1]
    out = [input_ids]
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for t in range(max_new_tokens):
        tok = logits[:, -1, :vocab].argmax(-1)
        if eos_id is not None:
            tok = torch.where(done, torch.full_like(tok, eos_id), tok)
            done |= tok == eos_id
        out.append(tok[:, None])
        if t == max_new_tokens - 1 or (eos_id is not None and bool(done.all())):
            break
        logits = model(tok[:, None], past_key_values=cache, num_recurrences=decode_recurrences).logits
    return torch.cat(out, 1), cache


# ----------------------------------------------------------------------------- files
def save_student(student: PrefillStudent, out: str | Path, meta: Optional[dict] = None) -> Path:
    from safetensors.torch import save_file

    from megaloop.runtime.files import atomic_write_file, atomic_write_text

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous().cpu() for k, v in student.state_dict().items()}
    atomic_write_file(out / "student.safetensors", lambda tmp: save_file(weights, tmp, metadata={"format": FORMAT}))
    info = {"format": FORMAT, "version": 1, "num_layers": student.num_layers, "init_state": student.init_state,
            "teacher_config": student.config.to_dict(), **(meta or {})}
    atomic_write_text(out / "student.json", json.dumps(info, indent=1, default=str))
    return out


def load_student(path: str | Path, device=None, dtype=None) -> tuple[PrefillStudent, dict]:
    """``(student in eval mode, the student.json dict)``."""
    from safetensors.torch import load_file

    from megaloop.hf.configuration_megaloop import MegaloopConfig

    path = Path(path)
    info = json.loads((path / "student.json").read_text())
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} folder (student.json)")
    for key, kind in (("teacher_config", dict), ("num_layers", int), ("init_state", str)):
        if not isinstance(info.get(key), kind):  # a wrong shape was an AttributeError / TypeError traceback
            raise ValueError(f"{path / 'student.json'}: {key!r} must be of type {kind.__name__}, got "
                             f"{info.get(key)!r:.60}")
    config = MegaloopConfig.from_dict(info["teacher_config"])
    student = PrefillStudent(config, info["num_layers"], info["init_state"])
    student.load_state_dict(load_file(str(path / "student.safetensors")))
    return student.to(device=device, dtype=dtype).eval(), info


# ----------------------------------------------------------------------------- data
def token_stream(tokenizer, source: str = "default", max_chars: Optional[int] = None,
                 info: Optional[dict] = None) -> torch.Tensor:
    """1-D token ids: the embedded corpus (``default``: its *training* documents only, so the
    student never sees the validation/screen text it is evaluated on), a ``.txt`` file, or a
    ``.jsonl`` file of ``{"text": ...}`` records; documents joined with EOS. ``max_chars`` stops
    reading (the default corpus has ~33M characters); ``info``, when given, receives ``documents_read``,
    ``documents`` and ``truncated`` so a caller can say that the data was cut short."""
    texts: list[str]
    if source == "default":
        from megaloop.data.default_corpus import _holdout, corpus_documents

        holdout = _holdout()
        texts = [d["text"] for d in corpus_documents() if holdout.band(d["text"]) == "train"]
    elif source.endswith(".jsonl"):
        texts = jsonl_texts(source)
    else:
        texts = [Path(source).read_text()]
    ids: list[int] = []
    chars = read = 0
    for t in texts:
        ids.extend(tokenizer.encode(t))
        ids.append(tokenizer.eos_id)
        chars += len(t)
        read += 1
        if max_chars is not None and chars >= max_chars:
            break
    if info is not None:
        info.update(documents_read=read, documents=len(texts), characters_read=chars, truncated=read < len(texts))
    return torch.tensor(ids, dtype=torch.long)


def jsonl_texts(path: str | Path) -> list[str]:
    """The ``"text"`` of each record of a JSONL file; ``ValueError`` naming ``file:line`` and what is
    wrong (not UTF-8, not a JSON object, no ``"text"``, a ``"text"`` that is not a string)."""
    from megaloop.post.rl.examples import read_jsonl

    texts = []
    for lineno, rec in read_jsonl(path, required=("text",)):
        if not isinstance(rec["text"], str):
            raise ValueError(f"{path}:{lineno}: \"text\" must be a string, got {type(rec['text']).__name__} "
                             f"{json.dumps(rec['text'])[:40]}")
        texts.append(rec["text"])
    if not texts:
        raise ValueError(f"{path}: no records")
    return texts


def window_batches(ids: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0,
                   device=None) -> Iterator[torch.Tensor]:
    """Endless random windows [batch_size, seq_len] of ``ids``."""
    if ids.numel() <= seq_len:
        raise ValueError(f"token stream of {ids.numel()} tokens is shorter than seq_len={seq_len}")
    rng = random.Random(seed)
    while True:
        starts = [rng.randrange(0, ids.numel() - seq_len) for _ in range(batch_size)]
        yield torch.stack([ids[s:s + seq_len] for s in starts]).to(device)


def config_dict(cfg: DistillConfig) -> dict:
    return asdict(cfg)
