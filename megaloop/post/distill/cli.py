"""``megaloop distill-prefill``: train a prefill student (SPEC §10).

    megaloop distill-prefill --teacher hf/S --out students/S --depth 5 --steps 2000 \\
        --batch-size 8 --seq-len 512 --lambda-kl 1.0 [--data default|FILE.txt|FILE.jsonl]

``--teacher`` is a megaloop checkpoint (under several processes every rank reads it whole) or an HF
folder. Writes ``OUT/student.safetensors``, ``OUT/student.json`` (teacher config, σ_T², depth, λ_KL,
held-out metrics before and after) and ``OUT/metrics.jsonl``. Use it with
:func:`megaloop.post.distill.prefill_student.student_prefill` (or ``--student OUT`` of ``megaloop eval``
/ ``megaloop generate``).

Experiments: ``--student-init random`` (a fresh student of the same shape instead of the core's
copy), ``--no-hidden-loss`` / ``--no-kl-loss`` (drop one loss term). Several processes
(``torchrun --nproc_per_node N -m megaloop.cli distill-prefill --deepspeed zero3 ...``) train the
student under DeepSpeed ZeRO-1/2/3, each rank on its share of ``--batch-size`` rows (the teacher is
replicated, frozen); rank 0 writes the folder. ``--save-every N`` checkpoints into
``OUT/checkpoints``; ``--resume`` continues from the latest exactly. SIGTERM / SIGUSR1 (slurm's
pre-emption warning) / Ctrl-C during training checkpoint there at the next step boundary (whatever
``--save-every``; every rank agrees on it) and exit 75 / 130 (:mod:`megaloop.runtime.stop`); a second Ctrl-C
stops at once without saving. An ``--out`` that already holds a
student is refused unless ``--resume`` or ``--overwrite`` is given; one that holds another tool's
folder (a pretraining run, an RL run, an HF model) is refused whatever the flags. ``--resume`` needs the
same flags, engine and number of processes (checked before the teacher loads). The deepspeed launcher
works as for ``rl`` (its ``--local_rank`` is dropped)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from megaloop.post.runs import DISTILL_SIDECAR as RUN_FILE  # next to each checkpoint: its step, σ_T², the flags
from megaloop.runtime.argtypes import seed_int
from megaloop.runtime.files import nonempty_path


def build_parser() -> argparse.ArgumentParser:
    from megaloop.post.rl.io import add_run_folder_args

    p = argparse.ArgumentParser(prog="megaloop distill-prefill", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, help="megaloop checkpoint or HF folder")
    p.add_argument("--out", required=True, type=nonempty_path, help="output folder for the student")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json / dir, 'default' or 'bytes' (default: the teacher's)")
    p.add_argument("--data", default="default", help="'default' (embedded corpus), FILE.txt or FILE.jsonl ({'text': ...})")
    p.add_argument("--max-chars", type=int, default=4_000_000,
                   help="stop reading documents once this many characters are read (default 4M, ~1M tokens; "
                        "0: all; a .txt file is one document, read whole)")
    p.add_argument("--depth", type=int, default=5, help="teacher depth R of the targets")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=None,
                   help="linear warm-up steps, then cosine decay to 0.1·--lr (given: must be < --steps; "
                        "default 20, shortened to --steps - 1 on a shorter run)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--lambda-kl", type=float, default=1.0)
    p.add_argument("--calib-batches", type=int, default=8)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=None, help="student layers (default: the teacher's n_core)")
    p.add_argument("--init-state", choices=("teacher", "zero"), default="teacher")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--student-init", choices=("teacher", "random"), default="teacher",
                   help="student weights: a copy of the teacher's core, or a fresh random init")
    p.add_argument("--no-hidden-loss", action="store_true", help="drop the hidden-state (endpoint MSE) term")
    p.add_argument("--no-kl-loss", action="store_true", help="drop the KL term (same as --lambda-kl 0)")
    p.add_argument("--clip-grad", type=float, default=1.0)
    add_run_folder_args(p, "zero1 | zero2 | zero3", "student")
    return p


def main(argv: list[str] | None = None) -> int:
    """``megaloop distill-prefill ...``; a :class:`~megaloop.errors.UserError` exits 2 with one line."""
    from megaloop.errors import UserError, report

    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except UserError as err:
        return report(err, "megaloop distill-prefill")
    except KeyboardInterrupt:  # one line; --resume named only when a checkpoint exists
        from megaloop.post.runs import interrupted_line

        print(interrupted_line("megaloop distill-prefill", args.out), file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    import torch

    from megaloop.post.distill.prefill_student import (DistillConfig, PrefillStudent, calibrate_sigma2, config_dict,
                                                  evaluate_student, save_student, token_stream, train_student,
                                                  window_batches)
    from megaloop.post.distill.student_lm import weights_digest
    from megaloop.config_utils import ConfigError
    from megaloop.errors import report
    from megaloop.hf.load import check_model_path, load_model
    from megaloop.post.ds_config import load_ds_config
    from megaloop.post.engine import init_post_distributed, launched_world, make_engine
    from megaloop.post.rl.io import check_out, model_tokenizer, tokenizer_identity, warn_rope_extrapolation
    from megaloop.post.runs import latest_tag
    from megaloop.runtime.stop import SignalStop, exit_code, stop_line

    _check_flags(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        cfg = DistillConfig(depth=args.depth, lambda_kl=0.0 if args.no_kl_loss else args.lambda_kl, steps=args.steps,
                            batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                            warmup=DistillConfig.warmup if args.warmup is None else args.warmup,
                            weight_decay=args.weight_decay, clip_grad=args.clip_grad, calib_batches=args.calib_batches,
                            seed=args.seed, log_every=args.log_every, hidden_loss=not args.no_hidden_loss)
    except ValueError as err:  # DistillConfig's checks
        return report(err, "megaloop distill-prefill")
    args_out = Path(args.out)
    ckpt = check_out(args_out, "student", resume=args.resume, overwrite=args.overwrite, model=args.teacher,
                     model_flag="--teacher")
    ds_config = None
    if args.deepspeed is not None:
        ds_config = load_ds_config(args.deepspeed, global_batch=cfg.batch_size, world=launched_world(),
                                   clip_grad=cfg.clip_grad, batch_flag="--batch-size")
    record = _run_record(args, cfg)
    stored = _check_resume(ckpt, record, args.deepspeed) if args.resume else {}
    check_model_path(args.teacher, "--teacher")
    _check_data(args.data)
    info, device = init_post_distributed(args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
                                         args.deepspeed)
    lead = info.rank == 0
    say = print if lead else (lambda *_a, **_k: None)
    teacher, source = load_model(args.teacher, tokenizer=args.tokenizer)
    if not teacher.config.looped:
        raise ConfigError(f"--teacher {args.teacher}: not a looped model")
    warn_rope_extrapolation(teacher, args.seq_len, f"--seq-len {args.seq_len} sequences")
    tok = model_tokenizer(args.tokenizer, args.teacher, source)
    if tok is None:
        raise ConfigError(f"--teacher {args.teacher}: no tokenizer found; pass --tokenizer")
    teacher.to(device).eval()
    digest = weights_digest(teacher)
    _check_same_teacher(stored.get("teacher_digest"), digest, args.teacher, ckpt)
    record["tokenizer_sha256"] = tokenizer_identity(tok)["tokenizer_sha256"]  # compared by content on --resume
    if isinstance(stored.get("run"), dict):
        _compare_runs(stored["run"], record, f"{ckpt}/{latest_tag(ckpt)}", teacher_digest=bool(stored.get("teacher_digest")))
    try:
        read: dict = {}
        ids = token_stream(tok, args.data, args.max_chars or None, info=read)
        if read["truncated"] and lead:
            print(f"note: --data {args.data}: read {read['documents_read']} of {read['documents']} documents "
                  f"({read['characters_read']:,} characters, --max-chars {args.max_chars:,}; 0 reads all)",
                  file=sys.stderr)
        n_eval = max(args.seq_len + 1, ids.numel() // 20)
        train_ids, eval_ids = ids[:-n_eval], ids[-n_eval:]
        batches = window_batches(train_ids, cfg.batch_size, cfg.seq_len, cfg.seed, device)
        eval_it = window_batches(eval_ids, cfg.batch_size, min(cfg.seq_len, n_eval - 1), cfg.seed + 1, device)
        eval_set = [next(eval_it) for _ in range(args.eval_batches)]
        calib = [next(batches) for _ in range(cfg.calib_batches)]
    except (OSError, ValueError, KeyError, TypeError) as err:  # the --data file's content
        raise ConfigError(f"--data {args.data}: {str(err).splitlines()[0]}") from None
    if stored.get("sigma2") is not None:  # the checkpoint's σ_T² (the calibration batches are still drawn)
        sigma2 = float(stored["sigma2"])
        say(f"sigma_T^2 = {sigma2:.6g} (from the checkpoint)")
    else:
        sigma2 = calibrate_sigma2(teacher, calib, cfg.depth)
        say(f"sigma_T^2 = {sigma2:.6g} (teacher depth {cfg.depth}, {cfg.calib_batches} batches)")
    student = PrefillStudent.from_teacher(teacher, args.num_layers, args.init_state, init=args.student_init,
                                          seed=cfg.seed)
    before_eval = evaluate_student(teacher, student, eval_set, cfg, sigma2)
    say("held-out before: " + json.dumps({k: round(v, 5) for k, v in before_eval.items()}))
    if lead:
        args_out.mkdir(parents=True, exist_ok=True)
        if not args.resume:
            (args_out / "metrics.jsonl").unlink(missing_ok=True)
    engine = make_engine(student, ds_config, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                         clip_grad=cfg.clip_grad)
    start = 0
    if args.resume:
        client = engine.load(ckpt)
        if client is None:
            raise ConfigError(f"--resume: no checkpoint in {ckpt}")
        # flags not checked before the load: a ZeRO-3 checkpoint without its sidecar (written before the
        # sidecars, or killed between the save and the sidecar's write), whose client state is in
        # zero_pp_rank_0_mp_rank_00_model_states.pt, a file checkpoint_facts does not read
        if isinstance(client.get("run"), dict) and not stored.get("run"):
            _compare_runs(client["run"], record, f"{ckpt}/{latest_tag(ckpt)}",
                          teacher_digest=bool(client.get("teacher_digest")))
        if not stored.get("teacher_digest"):  # no sidecar read before the load
            _check_same_teacher(client.get("teacher_digest"), digest, args.teacher, ckpt)
        start = int(client["step"])
        if client.get("sigma2") is not None:
            sigma2 = float(client["sigma2"])
        say(f"resumed at step {start} from {ckpt}")
        old_steps = (client.get("run") or stored.get("run") or {}).get("steps")
        if lead and isinstance(old_steps, int) and old_steps != cfg.steps and 0 < start < cfg.steps:
            from dataclasses import replace

            from megaloop.post.distill.prefill_student import lr_at

            print(f"note: --steps {old_steps} -> {cfg.steps}: the learning-rate schedule (warm-up, cosine decay) "
                  f"now spans {cfg.steps} steps, so step {start} trains at lr {lr_at(cfg, start):.3g} (the last "
                  f"step trained, {start - 1}, was at {lr_at(replace(cfg, steps=old_steps), start - 1):.3g})",
                  file=sys.stderr, flush=True)
    saving = args.save_every or args.resume
    # training seconds over every launch: the checkpoint resumed from carries those of the steps before it
    before = float((client.get("seconds") if args.resume else 0.0) or 0.0)

    def save(step: int) -> None:
        from megaloop.post.runs import save_checkpoint, sidecar_fields

        state = {"step": step, "sigma2": sigma2, "run": record, "seconds": before + time.time() - t0,
                 "teacher_digest": digest}  # the sidecar: so --resume checks the flags before anything loads
        save_checkpoint(engine, ckpt, f"step{step:06d}", state, RUN_FILE,
                        sidecar_fields(state, "megaloop distill-prefill", engine))

    if lead and args.warmup is None and cfg.warmup >= cfg.steps > 0:
        from megaloop.post.distill.prefill_student import warmup_steps

        print(f"note: --warmup: the default {cfg.warmup} is not below --steps {cfg.steps}: this run warms up over "
              f"{warmup_steps(cfg)} step(s)", file=sys.stderr, flush=True)
    # SIGTERM/SIGUSR1/Ctrl-C from here on: checkpoint at the next step boundary and exit 75/130
    # (megaloop.runtime.stop); one during the last step or the final writes lets the run complete
    with SignalStop(lead=lead) as stop:
        t0 = time.time()
        res = train_student(teacher, student, batches, cfg, sigma2=sigma2,
                            metrics_path=args_out / "metrics.jsonl" if lead else None, log=say, engine=engine,
                            start_step=start, save_every=args.save_every, save=save if saving else None, stop=stop,
                            stop_save=save)
        if res["stop_signal"]:  # the same decision on every rank: no final gather, evaluation or output
            if lead:
                where = ckpt / f"step{res['step']:06d}" if res["stop_saved"] else None
                print(stop_line("megaloop distill-prefill", res["stop_signal"], res["step"], where), flush=True)
            return exit_code(res["stop_signal"])
        state = engine.full_state_dict()
        final = PrefillStudent(teacher.config, student.num_layers, student.init_state).to(device)
        final.load_state_dict(state)
        after = evaluate_student(teacher, final.eval(), eval_set, cfg, sigma2)
        say("held-out after:  " + json.dumps({k: round(v, 5) for k, v in after.items()}))
        if lead:
            save_student(final.cpu(), args_out, meta={
                "depth": cfg.depth, "sigma2": sigma2, "lambda_kl": cfg.lambda_kl, "hidden_loss": cfg.hidden_loss,
                "student_init": args.student_init, "teacher": source, "teacher_digest": digest,
                "data": args.data, "config": config_dict(cfg),
                "run": record, "world_size": info.world, "deepspeed": None if ds_config is None else
                {"config": args.deepspeed, "zero_stage": engine.stage},
                "train_seconds": round(before + time.time() - t0, 2),
                "launch_train_seconds": round(time.time() - t0, 2),
                "eval_before": before_eval, "eval_after": after,
                "final_train": res["history"][-1] if res["history"] else None})
            print(f"wrote {args_out}")
            if stop.received:
                print(f"megaloop distill-prefill: signal received during the last step or the final writes: the "
                      f"run is complete at step {res['step']}", flush=True)
        return 0



# the flags a resumed run must keep (name in the run record -> the option); --steps may grow
RESUME_FIELDS = {"teacher": "--teacher", "tokenizer": "--tokenizer", "data": "--data", "max_chars": "--max-chars",
                 "depth": "--depth", "lambda_kl": "--lambda-kl/--no-kl-loss", "hidden_loss": "hidden_loss (--no-hidden-loss)",
                 "batch_size": "--batch-size", "seq_len": "--seq-len", "lr": "--lr", "min_lr_ratio": "min_lr_ratio",
                 "warmup": "--warmup", "weight_decay": "--weight-decay", "clip_grad": "--clip-grad",
                 "calib_batches": "--calib-batches", "seed": "--seed", "num_layers": "--num-layers",
                 "init_state": "--init-state", "student_init": "--student-init", "deepspeed": "--deepspeed"}


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse out-of-range numeric flags (one line naming the flag) before anything is loaded."""
    import math

    from megaloop.config_utils import ConfigError

    def need(ok: bool, flag: str, what: str, value) -> None:
        if not ok:
            raise ConfigError(f"{flag}: must be {what}, got {value}")

    need(math.isfinite(args.lr) and args.lr > 0, "--lr", "a finite number > 0", args.lr)
    for flag, v in (("--lambda-kl", args.lambda_kl), ("--weight-decay", args.weight_decay),
                    ("--clip-grad", args.clip_grad)):
        need(math.isfinite(v) and v >= 0, flag, "a finite number >= 0", v)
    for flag, v, lo in (("--depth", args.depth, 1), ("--steps", args.steps, 0), ("--batch-size", args.batch_size, 1),
                        ("--seq-len", args.seq_len, 2), ("--warmup", args.warmup or 0, 0),
                        ("--calib-batches", args.calib_batches, 1), ("--eval-batches", args.eval_batches, 1),
                        ("--log-every", args.log_every, 1), ("--save-every", args.save_every, 0),
                        ("--max-chars", args.max_chars, 0)):
        need(v >= lo, flag, f">= {lo}", v)
    if args.warmup and args.warmup >= args.steps:  # as `megaloop train` refuses warm-up >= max_steps
        raise ConfigError(f"--warmup {args.warmup}: must be < --steps {args.steps} (the warm-up would not end "
                          "before the run does)")
    if args.num_layers is not None:
        need(args.num_layers >= 1, "--num-layers", ">= 1 (leave it out for the teacher's n_core)", args.num_layers)
    if args.threads is not None:
        need(args.threads >= 1, "--threads", ">= 1", args.threads)


def _run_record(args: argparse.Namespace, cfg) -> dict:
    """The flags a checkpoint is tied to (stored with it; compared on --resume)."""
    from megaloop.post.distill.prefill_student import config_dict

    rec = {k: v for k, v in config_dict(cfg).items() if k in RESUME_FIELDS}
    rec.update(teacher=str(Path(args.teacher).resolve()), tokenizer=args.tokenizer, data=args.data
               if args.data == "default" else str(Path(args.data).resolve()), max_chars=args.max_chars,
               num_layers=args.num_layers, init_state=args.init_state, student_init=args.student_init,
               deepspeed=args.deepspeed, steps=cfg.steps)
    if args.data != "default" and Path(args.data).is_file():  # a moved copy resumes (compared by content)
        from megaloop.data.tokenizer import file_sha256

        rec["data_sha256"] = file_sha256(args.data)
    return rec


def _compare_runs(old: dict, new: dict, where: str, *, teacher_digest: bool = False) -> None:
    """Refuse (one line, each flag old -> new) a --resume whose run record ``new`` differs from the
    checkpoint's ``old``. ``teacher_digest``: the checkpoint recorded its teacher's weights digest, which
    decides once the teacher loads (:func:`_check_same_teacher`), so its path may move; --data is
    compared by content where both records hold its SHA-256."""
    from megaloop.config_utils import ConfigError

    def same(k: str) -> bool:
        if k == "teacher" and teacher_digest or k == "tokenizer" and old.get("tokenizer_sha256"):
            return True  # by content: the teacher's weights, the tokenizer's SHA-256 (below, once it is known)
        if k == "data" and old.get("data_sha256") and new.get("data_sha256"):
            return old["data_sha256"] == new["data_sha256"]
        return old[k] == new.get(k)

    diffs = [f"{RESUME_FIELDS[k]} {old[k]!r} -> {new.get(k)!r}" for k in RESUME_FIELDS if k in old and not same(k)]
    was, now = old.get("tokenizer_sha256"), new.get("tokenizer_sha256")
    if was and now and was != now:  # the teacher's own (--tokenizer left out) had no check: a moved copy may hold another
        what = f"--tokenizer {new['tokenizer']!r}" if new.get("tokenizer") else "the teacher's tokenizer"
        diffs.append(f"{what} (sha256 {was[:12]} -> {now[:12]})")
    if diffs:
        raise ConfigError(f"--resume: {where} was trained with other flags: {', '.join(diffs)}; resume with the "
                          "same flags (only --steps may grow) or start a fresh --out")


def _check_same_teacher(saved: str | None, digest: str, teacher: str, ckpt: Path) -> None:
    """Refuse a --resume whose --teacher holds other weights than the run's (its files replaced in
    place: the path alone was compared, and the student kept the old σ_T² against the new teacher)."""
    from megaloop.config_utils import ConfigError

    if saved and saved != digest:
        raise ConfigError(f"--resume: --teacher {teacher} holds other weights than the teacher the checkpoints in "
                          f"{ckpt} were trained against (weights digest {saved[:12]} -> {digest[:12]}); resume "
                          "with that teacher, or start a new --out")


def _check_resume(ckpt: Path, record: dict, deepspeed: str | None) -> dict:
    """The latest checkpoint's stored state (``{"step", "sigma2", "run", "seconds"}`` where known), after
    refusing a --resume on another engine or process count, whose flags differ from the checkpoint's, or
    whose --steps is below its step."""
    from megaloop.config_utils import ConfigError
    from megaloop.post.engine import launched_world
    from megaloop.post.runs import check_layout, check_tool, checkpoint_facts, resume_tag

    tag = resume_tag(ckpt)
    stored = checkpoint_facts(ckpt, tag, RUN_FILE)
    check_tool(stored, f"{ckpt}/{tag}", "student")
    if isinstance(stored.get("run"), dict):
        _compare_runs(stored["run"], record, f"{ckpt}/{tag}", teacher_digest=bool(stored.get("teacher_digest")))
    check_layout(stored, f"{ckpt}/{tag}", world=launched_world(), deepspeed=deepspeed)
    step = stored.get("step")
    if isinstance(step, int) and record["steps"] < step:
        raise ConfigError(f"--steps {record['steps']}: below the checkpoint's step {step} ({ckpt}/{tag})")
    return stored


def _check_data(data: str) -> None:
    """Refuse a --data file that is missing, empty or not UTF-8, or a JSONL file with a bad record
    (``file:line`` and what is wrong), before anything is loaded."""
    from megaloop.config_utils import ConfigError

    if data == "default":
        return
    p = Path(data)
    if p.is_dir():
        raise ConfigError(f"--data {p}: is a directory, not a file (give FILE.txt, FILE.jsonl or 'default')")
    if not p.is_file():
        raise ConfigError(f"--data {p}: no such file")
    raw = p.read_bytes()
    if not raw.strip():
        raise ConfigError(f"--data {p}: the file is empty")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise ConfigError(f"--data {p}:{line}: not UTF-8 text") from None
    if p.suffix == ".jsonl":  # every record {"text": str}, named by file:line
        from megaloop.post.distill.prefill_student import jsonl_texts

        try:
            jsonl_texts(p)
        except ValueError as err:
            raise ConfigError(f"--data {err}") from None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
