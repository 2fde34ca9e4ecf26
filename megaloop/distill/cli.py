"""``megaloop distill-prefill`` / ``tools/distill_prefill.py``: train a prefill student (SPEC §10).

    python tools/distill_prefill.py --teacher hf/S --out students/S --depth 5 --steps 2000 \\
        --batch-size 8 --seq-len 512 --lambda-kl 1.0 [--data default|FILE.txt|FILE.jsonl]

``--teacher`` is a megaloop checkpoint or an HF folder. Writes ``OUT/student.safetensors``,
``OUT/student.json`` (teacher config, σ_T², depth, λ_KL, held-out metrics before and after) and
``OUT/metrics.jsonl``. Use it with :func:`megaloop.distill.prefill_student.student_prefill`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megaloop distill-prefill", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, help="megaloop checkpoint or HF folder")
    p.add_argument("--out", required=True, help="output folder for the student")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json / dir, 'default' or 'bytes' (default: the teacher's)")
    p.add_argument("--data", default="default", help="'default' (embedded corpus), FILE.txt or FILE.jsonl ({'text': ...})")
    p.add_argument("--max-chars", type=int, default=None, help="read at most this many characters of the data")
    p.add_argument("--depth", type=int, default=5, help="teacher depth R of the targets")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--lambda-kl", type=float, default=1.0)
    p.add_argument("--calib-batches", type=int, default=8)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=None, help="student layers (default: the teacher's n_core)")
    p.add_argument("--init-state", choices=("teacher", "zero"), default="teacher")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from megaloop.distill.prefill_student import (DistillConfig, PrefillStudent, calibrate_sigma2, config_dict,
                                                  evaluate_student, save_student, token_stream, train_student,
                                                  window_batches)
    from megaloop.rl.io import load_model, model_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    teacher, source = load_model(args.teacher)
    if not teacher.config.looped:
        print("error: the teacher is not a looped model", file=sys.stderr)
        return 2
    tok = model_tokenizer(args.tokenizer, args.teacher, source)
    if tok is None:
        print(f"error: no tokenizer found for {args.teacher}; pass --tokenizer", file=sys.stderr)
        return 2
    teacher.to(device).eval()
    cfg = DistillConfig(depth=args.depth, lambda_kl=args.lambda_kl, steps=args.steps, batch_size=args.batch_size,
                        seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay,
                        calib_batches=args.calib_batches, seed=args.seed, log_every=args.log_every)
    try:
        ids = token_stream(tok, args.data, args.max_chars)
        n_eval = max(args.seq_len + 1, ids.numel() // 20)
        train_ids, eval_ids = ids[:-n_eval], ids[-n_eval:]
        batches = window_batches(train_ids, cfg.batch_size, cfg.seq_len, cfg.seed, device)
        eval_it = window_batches(eval_ids, cfg.batch_size, min(cfg.seq_len, n_eval - 1), cfg.seed + 1, device)
    except (OSError, ValueError, KeyError) as err:
        print(f"error: data {args.data}: {err}", file=sys.stderr)
        return 2
    eval_set = [next(eval_it) for _ in range(args.eval_batches)]
    calib = [next(batches) for _ in range(cfg.calib_batches)]
    sigma2 = calibrate_sigma2(teacher, calib, cfg.depth)
    print(f"sigma_T^2 = {sigma2:.6g} (teacher depth {cfg.depth}, {cfg.calib_batches} batches)")
    student = PrefillStudent.from_teacher(teacher, args.num_layers, args.init_state)
    before = evaluate_student(teacher, student, eval_set, cfg, sigma2)
    print("held-out before: " + json.dumps({k: round(v, 5) for k, v in before.items()}))
    args_out = Path(args.out)
    args_out.mkdir(parents=True, exist_ok=True)
    (args_out / "metrics.jsonl").unlink(missing_ok=True)
    t0 = time.time()
    res = train_student(teacher, student, batches, cfg, sigma2=sigma2, metrics_path=args_out / "metrics.jsonl")
    after = evaluate_student(teacher, student, eval_set, cfg, sigma2)
    print("held-out after:  " + json.dumps({k: round(v, 5) for k, v in after.items()}))
    save_student(student.cpu(), args_out, meta={
        "depth": cfg.depth, "sigma2": sigma2, "lambda_kl": cfg.lambda_kl, "teacher": source,
        "data": args.data, "config": config_dict(cfg), "train_seconds": round(time.time() - t0, 2),
        "eval_before": before, "eval_after": after,
        "final_train": res["history"][-1] if res["history"] else None})
    print(f"wrote {args_out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
