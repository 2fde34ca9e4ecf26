"""``megaloop generate`` (wired in megaloop/cli.py), and the model / engine options it shares with
``megaloop eval`` (:mod:`megaloop.eval.cli`): ``--checkpoint`` is a native checkpoint of any TP/PP
layout or an HF folder, loaded by :func:`megaloop.hf.load.load_model` (validated conversion)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

from megaloop.config_utils import ConfigError
from megaloop.errors import UserError
from megaloop.runtime.argtypes import nonempty_text, seed_int
from megaloop.runtime.files import atomic_write_text, json_safe, nonempty_path


# ----------------------------------------------------------------------------- shared options
def hide_options(p: argparse.ArgumentParser, *dests: str) -> None:
    """Leave options a command refuses out of its --help (``add_engine_options`` gives every verb them)."""
    for action in p._actions:
        if action.dest in dests:
            action.help = argparse.SUPPRESS


def add_engine_options(p: argparse.ArgumentParser, *, cache_choices=("terminal", "per_visit"),
                       cache_default="terminal", decode: bool = True) -> None:
    """``--checkpoint``, ``--json``, depths, cache, device / dtype, tokenizer, context, adaptive exit.

    ``decode=False`` (commands that never decode through a cache: ``eval states``, ``eval fixed-point``)
    leaves out the decode options (budgets, ``--cache``, adaptive exit) rather than accept and ignore
    them; ``cache_choices=None`` leaves out ``--cache`` alone. Left-out options keep their defaults."""
    p.add_argument("--checkpoint", required=True, type=nonempty_path,
                   help="megaloop checkpoint (step dir, RUN/checkpoints or RUN dir; any TP/PP layout) or HF folder")
    p.add_argument("--json", default=None, metavar="OUT", help="write the full result as JSON here")
    p.add_argument("--depth", type=int, default=None, help="recurrence depth R (default: the run's eval depth)")
    p.set_defaults(prefill_depth=None, decode_depth=None, cache=cache_default, exit=None, min_depth=None,
                   max_depth=None, finished_rows="mask")
    if decode:
        p.add_argument("--prefill-depth", type=int, default=None, help="prefill budget P (default R)")
        p.add_argument("--decode-depth", type=int, default=None, help="per-token decode budget D (default R)")
        if cache_choices:
            p.add_argument("--cache", choices=cache_choices, default=cache_default,
                           help="KV-cache mode" + (f" (default {cache_default})" if cache_default else
                                                   " (default both; terminal with --student)"))
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, auto (default)")
    p.add_argument("--dtype", default="fp32", help="fp32 (default), bf16, fp16")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json overriding the run's")
    p.add_argument("--max-context", type=int, default=None, help="longest sequence (default: training seq_len)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    if not decode:
        return
    p.add_argument("--exit", default=None, metavar="CRIT:VALUE", type=nonempty_text,
                   help="adaptive per-token decode depth: latent:1e-3 | kl:1e-4 | argmax:3 (default: fixed depth)")
    p.add_argument("--min-depth", type=int, default=None, help="adaptive: earliest exit (>= 2, default 2)")
    p.add_argument("--max-depth", type=int, default=None, help="adaptive: depth cap (default: decode depth)")
    p.add_argument("--finished-rows", choices=("mask", "compact"), default="mask",
                   help="adaptive: finished batch rows keep computing (mask) or drop out (compact)")


def add_memory_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-memory-check", action="store_true",
                   help="skip the estimate that refuses, before the first forward, a batch the device's free "
                        "memory cannot hold (megaloop.eval.memory)")


def decode_depth_bound(engine) -> int:
    """The deepest a decode step may recurse: the adaptive policy's cap, else the decode depth."""
    return int(engine.exit.max_depth) if engine.exit is not None else int(engine.decode_depth)


def add_student_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--student", default=None, metavar="DIR",
                   help="prefill through this distilled student (megaloop distill-prefill OUT; terminal cache); "
                        "decoding and scoring stay with the teacher")


def check_engine_args(args: argparse.Namespace) -> None:
    """Validate the cheap engine options (and that ``--checkpoint`` exists) before loading anything."""
    from megaloop.inference.kv_cache import check_depth

    for name in ("depth", "prefill_depth", "decode_depth"):
        if getattr(args, name) is not None:
            check_depth(getattr(args, name), "--" + name.replace("_", "-"))
    if args.max_context is not None and args.max_context < 1:
        raise ConfigError(f"--max-context: must be >= 1, got {args.max_context}")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads: must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(int(args.threads))
    from megaloop.hf.load import resolve_device

    resolve_device(args.device)  # ConfigError naming --device
    if getattr(args, "student", None) and getattr(args, "prefill_depth", None) is not None:
        raise ConfigError("--prefill-depth: with --student the prompt is prefilled by the student (prelude, its "
                          "layers, one teacher recurrence), not at a depth; drop --prefill-depth or --student")
    if getattr(args, "student", None) and getattr(args, "cache", "terminal") == "both":
        raise ConfigError("--student: the student's prefill fills a terminal cache; --cache both would also score "
                          "per_visit, which never runs it (use --cache terminal, the default with --student)")
    if getattr(args, "student", None) and getattr(args, "cache", "terminal") != "terminal":
        raise ConfigError(f"--student: the student's prefill fills a terminal cache; with --cache {args.cache} it "
                          "would never run (use --cache terminal, or drop --student)")
    if not getattr(args, "exit", None):  # the adaptive-depth options mean nothing without a criterion
        for flag, given in (("--min-depth", getattr(args, "min_depth", None) is not None),
                            ("--max-depth", getattr(args, "max_depth", None) is not None),
                            ("--finished-rows", getattr(args, "finished_rows", "mask") != "mask")):
            if given:
                raise ConfigError(f"{flag}: applies to adaptive depth; add --exit latent:EPS|kl:EPS|argmax:K")
    if getattr(args, "exit", None):  # the criterion and depths (the default cap, the decode depth, where known)
        from megaloop.inference.adaptive import exit_policy

        known = _known_decode_depth(args)
        exit_policy(args.exit, min_depth=args.min_depth, max_depth=args.max_depth,
                    default_max_depth=known if known is not None else max(args.min_depth or 2, 2),
                    finished_rows=args.finished_rows)
        dd = getattr(args, "decode_depth", None)
        if dd is not None and args.max_depth is not None and args.max_depth < dd:
            raise ConfigError(f"--max-depth: {args.max_depth} is below --decode-depth {dd}; with --exit the decode "
                              "depth is only the default cap of the adaptive depth: give --max-depth alone")
    tok = getattr(args, "tokenizer", None)
    if tok and not Path(tok).exists():
        raise ConfigError(f"--tokenizer {tok}: no such file or directory (a tokenizer.json, a SentencePiece "
                          ".model, or a folder holding one)")
    check_out_file(getattr(args, "json", None), "--json")
    if not Path(args.checkpoint).exists() and "://" not in args.checkpoint:
        from megaloop.train.checkpoint import CheckpointError

        raise CheckpointError(f"checkpoint {args.checkpoint} does not exist")
    check_untied_args(args)


def _known_decode_depth(args: argparse.Namespace) -> Optional[int]:
    """The engine's decode depth when the options fix it before loading (``--decode-depth``, else
    ``--depth``, its default); None when it comes from the checkpoint."""
    for name in ("decode_depth", "depth"):
        value = getattr(args, name, None)
        if value is not None:
            return int(value)
    return None


DEPTH_FLAGS = (("exit", "--exit"), ("depth", "--depth"), ("prefill_depth", "--prefill-depth"),
               ("decode_depth", "--decode-depth"), ("min_depth", "--min-depth"), ("max_depth", "--max-depth"))


def is_untied(args: argparse.Namespace) -> bool:
    """True when ``--checkpoint`` records ``arch: untied`` (read without loading the weights)."""
    from megaloop.hf.load import model_arch

    if "://" in str(args.checkpoint):
        return False
    if not hasattr(args, "_arch"):
        args._arch = model_arch(args.checkpoint)
    return args._arch == "untied"


def check_untied_args(args: argparse.Namespace) -> None:
    """An untied (non-looped) model has no recurrence: refuse the depth and adaptive-exit options
    before it loads (one line naming the flag)."""
    given = [(dest, flag) for dest, flag in DEPTH_FLAGS if getattr(args, dest, None) is not None]
    if not given or not is_untied(args):
        return
    dest, flag = given[0]
    what = "it has no recurrence to exit early from" if dest == "exit" else "it has no depth to vary"
    raise ConfigError(f"{flag}: {args.checkpoint} is an untied (non-looped) model, {what}")


INPUT_FLAGS = (("data", "--data"), ("tokenizer", "--tokenizer"), ("problems", "--problems"),
               ("student", "--student"), ("checkpoint", "--checkpoint"))


# what a command reads inside an input folder (a run, checkpoint, HF export, student or MDS set);
# other files there (an earlier eval's JSON or PNG, a log) may be written and rewritten
READ_NAMES = {"config.yaml", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "latest", "megaloop.json", "megaloop_conversion.json",
              "metrics.jsonl", "data.json", "student.json", "manifest.json", "index.json", "common.pt", ".metadata"}
READ_SUFFIXES = (".safetensors", ".pt", ".bin", ".distcp", ".py", ".mds", ".zstd")


def _read_by_the_command(path: Path, folder: Path) -> bool:
    rel = path.relative_to(folder)
    return (path.name in READ_NAMES or path.name.endswith(READ_SUFFIXES)
            or any(part == "checkpoints" or part.startswith("step_") for part in rel.parts[:-1]))


def check_outputs_not_inputs(args: argparse.Namespace, outputs: dict) -> None:
    """Refuse an output path (``outputs``: flag → path) that is one of the command's inputs (the same
    file once resolved: ``--data``, ``--tokenizer``, ``--problems``), or a file the command reads
    inside an input folder (``--checkpoint``, ``--student``, an MDS ``--data`` set, a tokenizer
    folder: weights, configs, tokenizer, checkpoints; ``READ_NAMES``), naming both flags. Other
    files in a run directory (an earlier result of the same command) may be written again."""
    for out_flag, out in outputs.items():
        if not out:
            continue
        o = Path(out).expanduser().resolve()
        for dest, in_flag in INPUT_FLAGS:
            value = getattr(args, dest, None)
            if not value or not isinstance(value, str) or "://" in value or value == "default":
                continue
            i = Path(value).expanduser().resolve()
            if o == i or (i.is_dir() and i in o.parents and _read_by_the_command(o, i)):
                what = "is" if o == i else "lies inside"
                raise ConfigError(f"{out_flag} {out}: {what} the input {in_flag} {value}; writing it would "
                                  f"overwrite the command's own input, choose another path")


def check_plot_path(plot: Optional[str], json_path: Optional[str], default: str, flag: str = "--plot") -> Path:
    """The figure path of ``--plot`` (default: next to ``--json``, else ``default`` in the working
    directory, or ``<stem>-2<ext>``, ``-3``, ... when that exists: a figure nobody named never replaces an
    earlier one), checked before any compute: a format matplotlib writes (no extension: PNG, ``.png``
    appended and said), not a directory, its parent creatable. Returns the path it will be written to."""
    if plot:
        path = Path(plot)
    elif json_path:
        path = Path(json_path).with_suffix(".png")
    else:
        path, n = Path(default), 1
        while path.exists() or path.is_symlink():
            n += 1
            path = Path(default).with_name(f"{Path(default).stem}-{n}{Path(default).suffix}")
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory, not a file path")
    ext = path.suffix[1:].lower()
    if not ext:
        path = path.with_name(path.name + ".png")
        print(f"note: {flag} {plot} has no extension: writing a PNG to {path}", file=sys.stderr)
    else:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = sorted(FigureCanvasBase.get_supported_filetypes())
        if ext not in formats:
            raise ConfigError(f"{flag} {path}: unsupported figure format {ext!r}; use one of {', '.join(formats)}")
    if json_path and path.expanduser().resolve() == Path(json_path).expanduser().resolve():
        where = f"{flag} {plot}" if plot else f"{flag} (default {path}, next to --json)"
        raise ConfigError(f"{where}: is also the --json path, so the figure would overwrite the JSON result; "
                          f"give {flag} another path")
    check_out_file(str(path), flag)
    return path


def check_out_file(path: Optional[str], flag: str) -> None:
    """An output file path that can be written: not a directory, and its nearest existing ancestor
    a directory in which a file can be created (so a long evaluation does not fail at its very end).
    The ancestor is probed with a temporary file, created and removed at once: permission bits alone
    do not tell for root, a read-only mount or a pseudo file system such as ``/proc``."""
    if not path:
        return
    from megaloop.runtime.files import cannot_create_in, dangling_link, nearest_existing

    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {p}: is a directory, not a file path")
    parent = nearest_existing(p.parent)
    # created under a link that points nowhere, or written through one whose target's folder is missing
    link = dangling_link(parent) or (dangling_link(p) if not Path(os.path.realpath(p)).parent.is_dir() else None)
    if link:
        raise ConfigError(f"{flag} {p}: {link}, so the path cannot be created")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {p}: {parent} is a file, so the path cannot be created")
    why = cannot_create_in(parent)
    if why is not None:
        raise ConfigError(f"{flag} {p}: {parent} is not writable (cannot create a file in it: {why})")
    if p.exists() and not os.access(p, os.W_OK):
        raise ConfigError(f"{flag} {p}: the file exists and is not writable")


def build_engine(args: argparse.Namespace, *, cache_mode: str = "terminal", dtype: Optional[str] = None):
    """The :class:`~megaloop.inference.engine.InferenceEngine` of the options (``--student`` attached)."""
    from megaloop.inference.engine import InferenceEngine

    engine = InferenceEngine.load(args.checkpoint, device=args.device, dtype=dtype or args.dtype,
                                  tokenizer=args.tokenizer, student=getattr(args, "student", None), depth=args.depth,
                                  prefill_depth=args.prefill_depth, decode_depth=args.decode_depth,
                                  cache_mode=cache_mode, max_context=args.max_context, exit_criterion=args.exit,
                                  min_depth=args.min_depth, max_depth=args.max_depth, finished_rows=args.finished_rows)
    src = engine.source
    if src.get("kind") == "checkpoint" and Path(src["path"]).resolve() != Path(args.checkpoint).resolve():
        print(f"checkpoint: {src['path']} (step {src.get('step')}, the newest in {args.checkpoint})", file=sys.stderr,
              flush=True)  # a run training there saves newer ones: which step a result is of (it was in --json only)
    cmd = getattr(args, "eval_cmd", None) or getattr(args, "cmd", None)
    if cmd in ("generate", "ppl", "harness"):  # the commands that prefill and decode (harness: generate_until
        keys = ["prefill_recurrences"] * (getattr(args, "student", None) is None)  # requests, any --cache)
        keys += ["decode_recurrences"] * (cmd != "ppl" or args.exit is not None)  # ppl: one parallel pass
        keys += ["kv_cache_mode"] * (cmd != "ppl")  # ppl scores the protocols --cache names
        note_folder_generation_settings(engine, keys)
    return engine


def note_folder_generation_settings(engine, keys: list[str]) -> None:
    """One note on stderr when an HF folder's config.json sets generation settings (``keys`` of
    ``prefill_recurrences``, ``decode_recurrences``, ``kv_cache_mode``: HF ``generate``'s defaults, those
    the command uses) other than the ones this command runs at: megaloop takes its own options (default
    the depth R and the terminal cache), and ran at them without a word while HF generate on the same
    folder used the folder's."""
    if engine.source.get("kind") != "hf":
        return
    runs_at = {"prefill_recurrences": engine.prefill_depth, "decode_recurrences": engine.decode_depth,
               "kv_cache_mode": engine.cache_mode}
    folder = {k: getattr(engine.config, k, None) for k in keys}
    differ = {k: (folder[k], runs_at[k]) for k in keys if folder[k] not in (None, runs_at[k])}
    if differ:
        flags = {"prefill_recurrences": "--prefill-depth", "decode_recurrences": "--decode-depth",
                 "kv_cache_mode": "--cache"}
        print(f"note: {engine.source['path']}'s config.json sets {', '.join(f'{k}={a}' for k, (a, _) in differ.items())}"
              f" (HF generate's defaults); this command runs at "
              f"{', '.join(f'{flags[k]} {b}' for k, (_, b) in differ.items())}, its own options", file=sys.stderr,
              flush=True)


def write_json(path: Optional[str], payload: dict) -> None:
    """``--json OUT``: the full result (no-op without it)."""
    if not path:
        return
    out = Path(path)
    text = json.dumps(json_safe(payload), indent=1, default=str, allow_nan=False)
    try:  # whole or not at all: a full disk or a kill mid-write truncated an earlier result in place
        if out.exists() and not out.is_file():  # /dev/stdout, a pipe: a stream, written as one (appended:
            with open(out, "a") as f:  # no truncation of what the stream already holds, a file behind a `>`)
                f.write(text + "\n")
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(os.path.realpath(out), text)  # through a link to the file it names
    except OSError as err:
        raise UserError(f"--json: cannot write {out}: {err.strerror or err}; nothing was written there") from None
    print(f"wrote {out}")


# ----------------------------------------------------------------------------- generate
def unescape_stop(text: str) -> str:
    """``--stop`` value: the escapes ``\\n``, ``\\t`` and ``\\\\`` become newline, tab and one backslash
    (a shell passes ``"\\n"`` as two characters); any other character, non-ASCII included, is kept."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "nt\\":
            out.append({"n": "\n", "t": "\t", "\\": "\\"}[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    if not out:
        raise argparse.ArgumentTypeError("must not be empty")
    return "".join(out)


def add_generate_parser(sub) -> None:
    """Add ``generate`` to ``sub``."""
    p = sub.add_parser("generate", help="generate text with prefill / decode budgets and a KV-cache mode")
    add_engine_options(p)
    add_student_option(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt at most (default 64)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="argmax decoding (the default)")
    mode.add_argument("--temperature", type=float, default=None, help="sample at this temperature")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--seed", type=seed_int, default=None, help="sampling seed (0 <= SEED < 2**64)")
    p.add_argument("--stop", action="append", default=[], type=unescape_stop,
                   help=r"stop string (repeatable); \n, \t and \\ are read as newline, tab and backslash, "
                        r"so --stop '\n\n' stops at a blank line")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    add_memory_option(p)
    p.set_defaults(fn=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    if args.temperature is None:  # greedy decoding: the sampling options would be ignored
        for flag, given in (("--top-k", args.top_k != 0), ("--top-p", args.top_p != 1.0),
                            ("--seed", args.seed is not None)):
            if given:
                raise ConfigError(f"{flag}: applies to sampling; add --temperature T (without it decoding is "
                                  "greedy)")
    if args.temperature is not None:  # checked before the model loads (was after: a load error hid them)
        from megaloop.inference.sampling import SamplingParams

        SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    for i, prompt in enumerate(args.prompt):  # bytes that are not UTF-8 reach Python as lone surrogates
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:
            ch = prompt[err.start]
            what = (f"byte 0x{ord(ch) - 0xDC00:02x}" if 0xDC80 <= ord(ch) <= 0xDCFF else f"U+{ord(ch):04X}")
            raise ConfigError(f"--prompt (#{i + 1}): not UTF-8 text ({what} at character {err.start})") from None
    check_engine_args(args)
    check_outputs_not_inputs(args, {"--json": args.json})
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    engine = build_engine(args, cache_mode=args.cache)
    if not args.no_memory_check:
        from megaloop.eval.memory import check_decode_memory, decode_positions

        lens = [max(len(engine.encode(p)), 1) for p in args.prompt]  # an empty prompt starts from EOS
        p, n = max(lens), len(lens)
        engine.check_context(p)  # a too-long prompt is named as such, not as a memory refusal
        total = decode_positions(lens, args.max_new_tokens, engine.max_context)
        check_decode_memory(engine, batch_size=n, prompt_len=p, total_len=total, prefill_depth=engine.prefill_depth,
                            decode_depth=decode_depth_bound(engine), mode=args.cache, padded=len(set(lens)) > 1,
                            what=f"{n} prompt(s) of up to {p} tokens + --max-new-tokens {args.max_new_tokens}",
                            fits="{n} prompt(s) at a time fit",
                            shrink="lower --max-new-tokens or --decode-depth" +
                            (" or use --cache terminal" if args.cache != "terminal" else ""))
    out = engine.generate(args.prompt if len(args.prompt) > 1 else args.prompt[0],
                          max_new_tokens=args.max_new_tokens,
                          temperature=0.0 if args.greedy or args.temperature is None else args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
                          stop_at_eos=not args.ignore_eos)
    tty = sys.stdout.isatty()
    for prompt, r in zip(args.prompt, out.results):
        print(f"{prompt}\033[1m{r.text}\033[0m" if tty else prompt + r.text)
        print(f"[{r.finish_reason}: {len(r.token_ids)} tokens]")
    s = out.stats
    prefill = "student" if getattr(args, "student", None) else s.prefill_depth  # the student ignores a depth
    print(f"{s.cache_mode} cache, P={prefill}, D={s.decode_depth}: prefill {s.prefill_s * 1e3:.1f} ms "
          f"({s.prompt_tokens} tokens), decode {s.decode_tokens_per_s:.1f} tokens/s, KV "
          f"{s.kv_bytes_per_token} B/token (per-visit would be {s.kv_bytes_per_token_per_visit}), "
          f"peak {s.kv_bytes_peak} B")
    if s.exit_criterion and s.mean_depth is None:  # every row stopped at the prefill's token (it was a traceback)
        print(f"adaptive {s.exit_criterion} ({s.finished_rows}): no adaptive decode steps")
    elif s.exit_criterion:
        hist = " ".join(f"{d}:{c}" for d, c in s.depth_histogram.items())
        print(f"adaptive {s.exit_criterion} ({s.finished_rows}): mean depth {s.mean_depth:.2f}, depth:tokens {hist}")
    # positions fed to the model: the prompt and every generated token but the last
    fed = max(r.prompt_tokens + max(len(r.token_ids) - 1, 0) for r in out.results)
    trained = int(engine.config.max_position_embeddings)
    if fed > trained:
        print(f"warning: a sequence reached {fed} positions, beyond the training seq_len {trained}: RoPE positions "
              f"{trained}..{fed - 1} were never trained and are extrapolated", file=sys.stderr)
    write_json(args.json, {"command": "generate", "engine": engine.describe(), "rope_extrapolated": fed > trained,
                           "results": [{"prompt": p, "text": r.text, "token_ids": r.token_ids,
                                        "finish_reason": r.finish_reason}
                                       for p, r in zip(args.prompt, out.results)],
                           "stats": {**s.to_dict(), **({"prefill_depth": "student"} if getattr(args, "student", None)
                                                       else {})}})
    return 0

