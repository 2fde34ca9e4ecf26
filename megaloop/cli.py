"""``megaloop`` command line: train, eval, generate, and the verbs of :data:`DELEGATED`.

Bad input (:class:`megaloop.errors.UserError`: config errors, bad checkpoints, bad data, ...)
exits with status 2 and a one-line message naming the field / file at fault (before any compute
where possible); each delegated verb's own ``main`` does the same.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

from megaloop.runtime.files import nonempty_path


def _quiet() -> None:
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*(\.grad attribute|cuda_graph_scope|tp_group is None).*")
    os.environ.setdefault("WANDB_SILENT", "true")
    if "DS_ACCELERATOR" not in os.environ:  # transformers/lm-eval import DeepSpeed, whose device probe warns
        import torch

        if not torch.cuda.is_available() and not torch.backends.mps.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"  # what the probe settles on here anyway, without the warning


def cmd_train(args: argparse.Namespace) -> int:
    from megaloop.config import load_config
    from megaloop.train.trainer import Trainer

    check_config_not_run_file(args.config, args.run_dir)
    cfg = load_config(args.config, args.overrides, arm=args.arm)
    return Trainer(cfg, args.run_dir, resume=args.resume).run()


def check_config_not_run_file(config: str, run_dir: str) -> None:
    """Refuse a ``--config`` file that is the run's own ``config.yaml`` unless it is a saved config
    as megaloop writes it: train rewrites that file with the resolved config, which would drop a
    hand-written file's comments and ``base:`` and bake this command's overrides into it."""
    from pathlib import Path

    import yaml

    from megaloop.config import resolve_config_path
    from megaloop.config_utils import ConfigError

    target = Path(run_dir) / "config.yaml"
    try:
        path = resolve_config_path(config)
        same = target.is_file() and path.is_file() and os.path.samefile(path, target)
        text = path.read_text() if same else ""
        data = yaml.safe_load(text) if same else None
    except (ConfigError, OSError, UnicodeDecodeError, yaml.YAMLError):
        return  # load_config names what is wrong with the file
    if not same or (isinstance(data, dict) and "base" not in data
                    and yaml.safe_dump(data, sort_keys=False) == text):
        return
    raise ConfigError(f"--config {config}: this is the run's own config.yaml, which train rewrites with the "
                      f"resolved config (its comments, base: and layout would be lost); copy it elsewhere "
                      f"(cp {path} my.yaml) and pass --config my.yaml")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megaloop", description="Looped-LM pretraining on megatron-core")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a model (torchrun for several processes)")
    t.add_argument("--config", default="tiny", help="preset name (tiny, S, M, L, untied4, ...) or YAML path")
    t.add_argument("--run-dir", default="runs/default", type=nonempty_path, help="metrics.jsonl, config.yaml, checkpoints/ (default runs/default)")
    t.add_argument("--resume", default=None, help="'auto' = latest complete checkpoint in RUN_DIR, or a path")
    t.add_argument("--arm", default=None,
                   help="a paper arm from megaloop/configs/arms.yaml (fixed5, pln5, learned, u64, untied12, ...), "
                        "applied after the preset and before the overrides")
    t.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. train.max_steps=20 model.injection=orthoinj")
    t.set_defaults(fn=cmd_train)
    # eval ppl|sweep|states|copying|fixed-point|harness|synth and generate: the pure-PyTorch model loaded from a native
    # checkpoint of any TP/PP layout (see megaloop/inference/engine.py for why).
    from megaloop.eval.cli import add_eval_parser
    from megaloop.inference.generate_cli import add_generate_parser

    add_eval_parser(sub)
    add_generate_parser(sub)
    for name, (_, text) in DELEGATED.items():  # listed in --help; handled by their own parsers
        sub.add_parser(name, help=text, add_help=False)
    return p


# subcommands whose arguments belong to the tool's own parser: `megaloop rl --help`
DELEGATED = {"rl": ("megaloop.post.rl.cli", "GRPO with endpoint reuse (SPEC §9)"),
             "distill-prefill": ("megaloop.post.distill.cli", "train a distilled-prefill student (SPEC §10)"),
             "plan": ("megaloop.plan.cli", "predict memory per rank, step time, bubble and MFU of a layout"),
             "lr-screen": ("megaloop.screen.cli", "learning-rate screen over a grid of runs (Appendix B.1)"),
             "reproduce": ("megaloop.repro.cli", "run one of the paper's experiments (arms, evaluation, report)"),
             "convert": ("megaloop.hf.convert_cli", "convert a checkpoint to a Hugging Face folder and back")}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse the command line; ``train``'s dotlist overrides may stand anywhere on it
    (``train a=1 --run-dir X b=2``): argparse hands back the ones after an option as extras, and
    those that look like ``key=value`` join the overrides in order."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        is_train = getattr(args, "cmd", None) == "train"
        overrides = [x for x in extra if is_train and "=" in x and not x.startswith("-")]
        rest = [x for x in extra if x not in overrides]
        if rest:
            _leaf_parser(parser, args).error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides = list(args.overrides) + overrides
    return args


def _leaf_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command given (``eval states``), so an unknown option is reported with
    that command's usage, not the top level's."""
    for dest in ("cmd", "eval_cmd"):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, dest, None)
        if not subs or name not in subs[0].choices:
            break
        parser = subs[0].choices[name]
    return parser


def _record_exit(code: object) -> None:
    """Write the exit status to ``$MEGALOOP_EXIT_STATUS_FILE`` (global rank 0 only), so launchers
    see 75 (checkpointed, requeue) or 130 through torchrun, which turns any failed worker into 1."""
    path = os.environ.get("MEGALOOP_EXIT_STATUS_FILE")
    if not path or os.environ.get("RANK", "0") != "0":
        return
    try:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(f"{code if isinstance(code, int) else 1}\n")
        os.replace(tmp, path)
    except OSError as err:
        print(f"megaloop: warning: cannot write MEGALOOP_EXIT_STATUS_FILE={path}: {err}", file=sys.stderr)


def _strip_local_rank(argv: list[str]) -> list[str]:
    """The DeepSpeed launcher (``deepspeed --module megaloop.cli rl ...``) puts ``--local_rank=N`` before
    the subcommand; the rank is in the environment too (LOCAL_RANK), so it is dropped here."""
    while argv and argv[0].split("=")[0] in ("--local_rank", "--local-rank"):
        flag = argv.pop(0)
        value = flag.split("=", 1)[1] if "=" in flag else (argv.pop(0) if argv else "")
        os.environ.setdefault("LOCAL_RANK", value)
    return argv


def main(argv: list[str] | None = None) -> None:
    from megaloop.runtime import setup_stop
    from megaloop.runtime.console import guard_stdout

    guard_stdout()  # `megaloop train ... | head`: a closed pipe turns the console off, the run goes on
    argv = _strip_local_rank(sys.argv[1:] if argv is None else list(argv))
    verb = argv[0] if argv else None
    previous = setup_stop.install(verb)  # SIGTERM/SIGUSR1 before a loop's own handler: one line
    try:
        from megaloop.runtime.orphan_guard import stop_with_launcher

        stop_with_launcher()  # a torchrun rank stops (checkpoint, exit 75) when torchrun is killed
        _main(argv, verb)
    except setup_stop.StopDuringSetup as stop:
        code = setup_stop.stopped_line(verb, stop.signum, argv)
        _record_exit(code)
        sys.exit(code)
    finally:
        setup_stop.restore(previous)


class _NotRaised(Exception):
    """Stands for NonFiniteLossError until its (heavy) module is imported: a SIGTERM during that
    import raised StopDuringSetup through ``except NonFiniteLossError`` on an unbound name
    (UnboundLocalError, a traceback and exit 1 in place of the one line and 75)."""


def _main(argv: list[str], verb: str | None) -> None:
    try:  # Ctrl-C while torch and the parsers load: one line, no traceback
        _quiet()
        if verb in DELEGATED:
            try:
                code = importlib.import_module(DELEGATED[verb][0]).main(argv[1:])
            except KeyboardInterrupt:  # Ctrl-C: one line and 130, as `megaloop train` (no traceback)
                hint = " (continue from its last checkpoint with --resume)" if verb in ("rl", "distill-prefill") else ""
                print(f"megaloop {verb}: interrupted{hint}", file=sys.stderr)
                code = 130
            except Exception as err:  # a full disk: one line (a traceback, exit 1, from most writers)
                from megaloop.runtime.files import report_storage_full

                code = report_storage_full(err, f"megaloop {verb}")
            _record_exit(code or 0)
            sys.exit(code)
        args = parse_args(argv)
    except KeyboardInterrupt:
        print("megaloop: interrupted (no checkpoint written by this interrupt)", file=sys.stderr)
        _record_exit(130)
        sys.exit(130)
    from megaloop.errors import UserError, report

    NonFiniteLossError = _NotRaised  # bound before the import: a stop signal may land inside it
    try:
        from megaloop.train.trainer import NonFiniteLossError  # heavy (megatron): inside, for Ctrl-C

        code = args.fn(args)
    except KeyboardInterrupt:  # Ctrl-C before training started, or a second one during it
        print("megaloop: interrupted (no checkpoint written by this interrupt)", file=sys.stderr)
        code = 130
    except UserError as err:
        code = report(err)
    except NonFiniteLossError as err:
        print(f"megaloop: stopped: {err}", file=sys.stderr)
        code = 3
    except Exception as err:  # a full disk, or a collective that another rank's exit broke: one line
        from megaloop.runtime.files import report_storage_full
        from megaloop.runtime.parallel import peer_lost_line

        if (line := peer_lost_line(err)) is not None:
            print(line, file=sys.stderr, flush=True)
            code = 1
        else:
            code = report_storage_full(err, f"megaloop {verb}" if verb else "megaloop")
    finally:
        from megaloop.runtime.parallel import destroy_distributed

        try:
            destroy_distributed()
        except Exception:
            pass
    _record_exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
