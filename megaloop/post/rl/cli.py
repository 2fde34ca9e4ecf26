"""``megaloop rl``: GRPO with endpoint reuse on a verifiable task (``megaloop rl grad-check --help``:
how well endpoint reuse approximates the recompute gradient on one rollout).

    megaloop rl --model runs/tiny/checkpoints --out hf/tiny-rl --task arithmetic \\
        --arm reuse --depth 5 --neumann-b 5 --steps 50 --group-size 8 --prompts 4

``--model`` is a megaloop checkpoint (step dir, ``RUN/checkpoints`` or ``RUN``; under several processes
every rank reads it whole) or an HF folder; ``--out`` receives an HF folder (weights, code files,
tokenizer, ``megaloop_rl.json`` with the config and final metrics) and ``metrics.jsonl`` (one record
per step). An ``--out`` that already holds an RL run is refused unless ``--resume`` (continue it) or
``--overwrite`` (replace it) is given; one that holds another tool's folder (a pretraining run, a
prefill student, an HF model) is refused whatever the flags (:mod:`megaloop.post.runs`).

``--task mbpp:PATH.jsonl`` (or ``mbpp:tiny``) scores completions by running them in a bubblewrap
sandbox (:mod:`megaloop.post.rl.sandbox`), ``--reward-workers`` at a time; without a working sandbox it
refuses to start unless ``--unsafe-code-exec`` is given. The isolation used is recorded
(``reward_isolation`` in ``metrics.jsonl``, ``reward_sandbox`` in ``megaloop_rl.json``).

Several processes (``torchrun --nproc_per_node N -m megaloop.cli rl --deepspeed zero2 ...``, or the
deepspeed launcher: ``deepspeed --num_gpus N --module megaloop.cli rl ...``, the rank comes from
the environment) train data-parallel under DeepSpeed
ZeRO-1/2 (:mod:`megaloop.post`): each rank
rolls out its share of the ``--prompts x --group-size`` rows, the advantages are normalised over
whole groups, and rank 0 writes the outputs. ``--save-every N`` keeps checkpoints in
``OUT/checkpoints`` (DeepSpeed's format under ``--deepspeed``, with an ``rl_run.json`` beside each);
``--resume`` continues from the latest one exactly, on the same ``--model``, settings, engine and
number of processes (checked before the model loads; ``--steps`` may grow; the ``--task`` file and the
tokenizer are compared by content, their SHA-256, wherever they lie). SIGTERM / SIGUSR1 (slurm's
pre-emption warning) / Ctrl-C during training checkpoint into ``OUT/checkpoints`` at the next step
boundary (whatever ``--save-every``; every rank agrees on it) and exit 75 / 130: ``--resume`` continues
exactly (:mod:`megaloop.runtime.stop`); a second Ctrl-C stops at once without saving. ``megaloop rl
grad-check --model M`` prints the reuse/recompute gradient cosine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from megaloop.post.rl.reuse import ARMS
from megaloop.runtime.argtypes import seed_int
from megaloop.runtime.files import nonempty_path


def build_parser() -> argparse.ArgumentParser:
    from megaloop.post.rl.io import add_run_folder_args

    p = argparse.ArgumentParser(prog="megaloop rl", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="megaloop checkpoint or HF folder")
    p.add_argument("--out", required=True, type=nonempty_path, help="output HF folder")
    p.add_argument("--task", default="arithmetic",
                   help="arithmetic | arithmetic-pm | gsm8k:PATH.jsonl | exact:PATH.jsonl | mbpp:PATH.jsonl | mbpp:tiny")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json / dir, 'default' or 'bytes' (default: the model's)")
    p.add_argument("--arm", choices=ARMS, default="reuse")
    p.add_argument("--depth", type=int, default=5, help="R (rollout prefill/decode, recompute/bptt depth)")
    p.add_argument("--neumann-b", type=int, default=5, help="b of Neumann-(b-1) for reuse/recompute")
    p.add_argument("--bptt-window", type=int, default=None, help="bptt arm: truncate to the last b recurrences")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--cache-mode", choices=("terminal", "per_visit"), default="terminal")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--loss-norm", choices=("sequence", "token"), default="sequence")
    p.add_argument("--no-scale-rewards", action="store_true", help="centre advantages without dividing by the std")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    add_run_folder_args(p, "zero1 | zero2", "run (its metrics.jsonl)")
    p.add_argument("--reward-workers", type=int, default=None,
                   help="mbpp: completions scored in parallel sandboxes (default 4)")
    p.add_argument("--reward-mode", choices=("all", "fraction"), default=None,
                   help="mbpp: 1.0 only when every test passes (all), or the share of tests passed (fraction)")
    p.add_argument("--unsafe-code-exec", action="store_true",
                   help="mbpp: allow running completions WITHOUT a sandbox when bubblewrap does not work here "
                        "(recorded in metrics.jsonl and megaloop_rl.json)")
    return p


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    """``megaloop rl [grad-check] ...``; a :class:`~megaloop.errors.UserError` exits 2 with one line,
    Ctrl-C 130 with one line (naming ``--resume`` only when a checkpoint exists to continue from)."""
    from megaloop.errors import UserError, report

    argv = list(sys.argv[1:] if argv is None else argv)
    args = None
    try:
        if argv and argv[0] == "grad-check":
            from megaloop.post.rl.grad_check import main as grad_check

            return grad_check(argv[1:])
        args = build_parser().parse_args(argv)
        return _run(args)
    except UserError as err:
        return report(err, "megaloop rl")
    except KeyboardInterrupt:
        from megaloop.post.runs import interrupted_line

        print(interrupted_line("megaloop rl", getattr(args, "out", None)), file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    import torch

    from megaloop.config_utils import ConfigError
    from megaloop.errors import report
    from megaloop.hf.load import check_model_path, load_model
    from megaloop.post.ds_config import load_ds_config
    from megaloop.post.engine import CheckpointMismatch, init_post_distributed, launched_world, make_engine
    from megaloop.post.rl.grpo import GRPOConfig, GRPOTrainer, config_dict, refuse_changes
    from megaloop.post.rl.io import check_out, early_tokenizer, model_tokenizer, save_hf, tokenizer_identity
    from megaloop.post.rl.tasks import make_task, task_identity
    from megaloop.post.runs import cut_metrics, resume_tag
    from megaloop.runtime.stop import SignalStop, exit_code, stop_line

    try:
        given = [flag for flag, value in (("--reward-workers", args.reward_workers), ("--reward-mode", args.reward_mode),
                                          ("--unsafe-code-exec", args.unsafe_code_exec or None)) if value is not None]
        if given and args.task.partition(":")[0] != "mbpp":  # they were ignored silently
            raise ValueError(f"{', '.join(given)}: configure the code-execution reward of mbpp: tasks; "
                             f"--task {args.task} runs no code")
        if args.bptt_window is not None and args.arm != "bptt" and args.bptt_window >= 1:  # ignored, yet recorded
            raise ValueError(f"--bptt-window: applies to --arm bptt only (this run: --arm {args.arm}, which "
                             "backpropagates through its endpoint); drop it")
        args.reward_workers = 4 if args.reward_workers is None else args.reward_workers
        args.reward_mode = args.reward_mode or "all"
        if args.reward_workers < 1:
            raise ValueError(f"--reward-workers must be >= 1, got {args.reward_workers}")
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        if args.save_every < 0:
            raise ValueError(f"--save-every must be >= 0 (0: no periodic checkpoints), "
                             f"got {args.save_every}")
        cfg = GRPOConfig(arm=args.arm, depth=args.depth, neumann_b=args.neumann_b,
                         bptt_window=args.bptt_window, group_size=args.group_size, prompts_per_step=args.prompts,
                         max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         cache_mode=args.cache_mode, scale_rewards=not args.no_scale_rewards,
                         loss_norm=args.loss_norm, kl_coef=args.kl_coef, lr=args.lr,
                         weight_decay=args.weight_decay, clip_grad=args.clip_grad or None, steps=args.steps,
                         seed=args.seed)
        task = make_task(args.task, reward_workers=args.reward_workers, unsafe_code_exec=args.unsafe_code_exec,
                         reward_mode=args.reward_mode)
        identity = task_identity(args.task)
    except ValueError as err:  # GRPOConfig / task options (a UserError or a plain ValueError)
        return report(err, "megaloop rl")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    metrics = out / "metrics.jsonl"
    ckpt = check_out(out, "rl", resume=args.resume, overwrite=args.overwrite, model=args.model)
    ds_config = None
    if args.deepspeed is not None:
        ds_config = load_ds_config(args.deepspeed, global_batch=args.prompts * args.group_size,
                                   world=launched_world(), clip_grad=cfg.clip_grad, stages=(0, 1, 2),
                                   batch_flag="--prompts x --group-size")
    meta = {**identity, "reward_mode": args.reward_mode, "model": str(Path(args.model).resolve())}
    stored = _check_resume(ckpt, cfg, meta, args.deepspeed) if args.resume else {}
    check_model_path(args.model, "--model")

    def tokenizer_meta(tok) -> None:  # recorded with the run; a --resume on another one is refused
        meta.update(tokenizer_identity(tok))
        if args.resume:
            refuse_changes({**(stored.get("config") or {}), **(stored.get("meta") or {})}, meta,
                           f"the checkpoint {ckpt}/{resume_tag(ckpt)}")

    tok = early_tokenizer(args.tokenizer, args.model)  # a checkpoint's own: known once it is read
    if tok is not None:
        tokenizer_meta(tok)
    info, device = init_post_distributed(args.device, args.deepspeed)
    model, source = load_model(args.model, num_recurrences=args.depth, tokenizer=args.tokenizer)
    if tok is None:
        tok = model_tokenizer(args.tokenizer, args.model, source)
        if tok is None:
            raise ConfigError(f"--model {args.model}: no tokenizer found; pass --tokenizer")
        tokenizer_meta(tok)
    source = {**source, "path": str(Path(source["path"]).resolve()), "tokenizer": meta["tokenizer"],
              "tokenizer_spec": args.tokenizer}  # the tokenizer used (absolute, or bytes) and as given
    from megaloop.post.distill.student_lm import weights_digest

    meta["model_digest"] = weights_digest(model)  # the KL reference and the start: by content, not by path
    if args.resume:
        refuse_changes({**(stored.get("config") or {}), **(stored.get("meta") or {})}, meta,
                       f"the checkpoint {ckpt}/{resume_tag(ckpt)}")
    warn_prompt_lengths(model, tok, task, args.task, args.max_new_tokens)
    model.to(device)
    lead = info.rank == 0
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        if not args.resume:
            metrics.unlink(missing_ok=True)
    t0 = time.time()
    engine = make_engine(model, ds_config, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                         clip_grad=cfg.clip_grad)
    trainer = GRPOTrainer(model, tok, task, cfg, log=print if lead else None, engine=engine, meta=meta,
                          record={"deepspeed": args.deepspeed, "world_size": info.world})
    if args.resume:
        try:
            loaded = trainer.load(ckpt)
        except CheckpointMismatch as err:  # another model shape: named with --model and where it was
            was = (stored.get("meta") or {}).get("model")
            hint = (f" ({was})" if was and was != meta["model"] else
                    " (the model at that path was replaced since?)" if was else "")
            raise ConfigError(f"--resume: the checkpoint in {ckpt} does not fit --model {args.model} (another "
                              f"model shape: {err.detail}); resume with the model it was trained "
                              f"from{hint}") from None
        if not loaded:
            raise ConfigError(f"--resume: no checkpoint in {ckpt}")
        if lead:
            cut = cut_metrics(metrics, trainer.step_no)
            print(f"resumed at step {trainer.step_no} from {ckpt}"
                  + (f" (dropped {cut} record(s) of later steps from {metrics.name})" if cut else ""))
    # SIGTERM/SIGUSR1/Ctrl-C from here on: checkpoint at the next step boundary and exit 75/130
    # (megaloop.runtime.stop); one during the last step or the final writes lets the run complete
    with SignalStop(lead=lead) as stop:
        history = trainer.train(metrics_path=metrics if lead else None,
                                save_dir=ckpt if (args.save_every or args.resume) else None,
                                save_every=args.save_every, stop=stop, stop_dir=ckpt)
        if trainer.stop_signal:  # the same decision on every rank: no final gather or output
            if lead:
                where = ckpt / f"step{trainer.step_no:06d}" if trainer.stop_saved else None
                print(stop_line("megaloop rl", trainer.stop_signal, trainer.step_no, where), flush=True)
            return exit_code(trainer.stop_signal)
        policy = engine.full_state_dict()
        if not lead:
            return 0
        model.load_state_dict(policy)
        model.config.num_recurrences = cfg.depth
        # the whole run's records (a resumed run's history holds only the steps it ran; metrics.jsonl was
        # cut back to the checkpoint, so it holds every step once) and its training time over every launch
        # (the checkpoint resumed from carries the seconds of the steps before it)
        if args.resume and metrics.is_file():
            history = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        summary = {"source": source, **{k: meta[k] for k in ("task", "task_sha256", "tokenizer", "tokenizer_sha256")},
                   "config": config_dict(cfg),
                   "seconds": round(trainer.seconds, 2), "launch_seconds": round(time.time() - t0, 2),
                   "world_size": info.world, "deepspeed": None if ds_config is None else
                   {"config": args.deepspeed, "zero_stage": engine.stage},
                   "reward_sandbox": task.sandbox_info() if hasattr(task, "sandbox_info") else None,
                   "final": history[-1] if history else None,
                   "reward_mean_first": history[0]["reward_mean"] if history else None,
                   "reward_mean_last": history[-1]["reward_mean"] if history else None}
        save_hf(model.cpu(), out, tok, extra=summary)
        print(json.dumps({k: summary[k] for k in ("reward_mean_first", "reward_mean_last", "seconds")}))
        print(f"wrote {out}")
        if stop.received:
            print(f"megaloop rl: signal received during the last step or the final writes: the run is "
                  f"complete at step {trainer.step_no}", flush=True)
        return 0


def warn_prompt_lengths(model, tok, task, spec: str, max_new_tokens: int) -> None:
    """Refuse a task prompt that encodes to no tokens (one line); warn once (RoPE extrapolation) when the
    longest prompt plus ``max_new_tokens`` completion tokens can pass the training length."""
    import random

    from megaloop.config_utils import ConfigError
    from megaloop.post.rl.io import warn_rope_extrapolation

    examples = getattr(task, "examples", None) or task.sample(64, random.Random(0))
    lengths = [len(tok.encode(ex.prompt)) for ex in examples]
    if min(lengths) == 0:
        raise ConfigError(f"--task {spec}: the prompt {examples[lengths.index(0)].prompt!r} encodes to no tokens; "
                          "give every record a prompt")
    longest = max(lengths)
    warn_rope_extrapolation(model, longest + max_new_tokens, f"prompts of up to {longest} tokens plus completions of "
                                                             f"--max-new-tokens {max_new_tokens}")


def _check_resume(ckpt: Path, cfg, meta: dict, deepspeed: str | None) -> dict:
    """The latest checkpoint's recorded facts (:func:`megaloop.post.runs.checkpoint_facts`), after
    refusing — before the model loads — a ``--resume`` on another engine or process count, with
    settings that change the training (each named, old → new; ``--model`` by path only for a checkpoint
    that recorded no weights digest, else by its weights once loaded) or with a ``--steps`` below the
    checkpoint's step."""
    from megaloop.config_utils import ConfigError
    from megaloop.post.engine import launched_world
    from megaloop.post.rl.grpo import config_dict, refuse_changes
    from megaloop.post.runs import RL_SIDECAR, check_layout, check_tool, checkpoint_facts, resume_tag

    tag = resume_tag(ckpt)
    where = f"{ckpt}/{tag}"
    facts = checkpoint_facts(ckpt, tag, RL_SIDECAR)
    check_tool(facts, where, "rl")
    check_layout(facts, where, world=launched_world(), deepspeed=deepspeed)
    old = {**(facts.get("config") or {}), **(facts.get("meta") or {})}
    refuse_changes(old, {**config_dict(cfg), **meta}, f"the checkpoint {where}")
    step = facts.get("step")
    if isinstance(step, int) and cfg.steps < step:
        raise ConfigError(f"--steps {cfg.steps}: below the checkpoint's step {step} ({where}); --steps is the "
                          f"run's total, so give at least {step}")
    return facts


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
