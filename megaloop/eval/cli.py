"""``megaloop eval ppl|sweep|states|copying|fixed-point|harness`` (wired in megaloop/cli.py).

Every command loads the pure-PyTorch model from ``--checkpoint`` (a native checkpoint of any
TP/PP layout — step dir, checkpoints dir or run dir — or an exported HF folder; the options are
:mod:`megaloop.inference.generate_cli`'s, shared with ``megaloop generate``), prints a rich table
and, with ``--json OUT``, writes the full result. Bad inputs raise
:class:`~megaloop.errors.UserError` subclasses (exit status 2, one line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from megaloop.config_utils import ConfigError
from megaloop.eval.tables import depth_summary, fmt, lengths, table
from megaloop.inference.generate_cli import (add_engine_options, add_memory_option, add_student_option, build_engine,
                                             check_engine_args, check_outputs_not_inputs, check_plot_path,
                                             hide_options, write_json)
from megaloop.runtime.argtypes import seed_int


# ----------------------------------------------------------------------------- parsers
def _common(p: argparse.ArgumentParser, *, cache_choices=("terminal", "per_visit"), cache_default="terminal",
            data: bool = True, decode: bool = True, batch: bool = True) -> None:
    add_engine_options(p, cache_choices=cache_choices, cache_default=cache_default, decode=decode)
    if data:
        p.add_argument("--data", default="default",
                       help="'default' (embedded validation set), an MDS validation directory, or a text file "
                            "(.txt/.raw: one document; .jsonl[.gz]/.parquet: one per row) tokenised with the "
                            "checkpoint's tokenizer")
        p.add_argument("--text-field", default=None,
                       help="JSONL field / parquet column of a .jsonl[.gz]/.parquet --data file (default: text)")
        p.add_argument("--max-seqs", type=int, default=None,
                       help="evaluate at most N sequences (default: all; states 16; fixed-point --per-source 0: 4)")
        p.add_argument("--seq-len", type=int, default=None,
                       help="tokens per evaluation sequence (paper: 8192; default: the MDS set's length, else "
                            "the training seq_len); beyond the training length RoPE positions are extrapolated")
        if batch:  # states traces its spans in one forward, fixed-point solves span by span
            p.add_argument("--batch-size", type=int, default=4, help="sequences per forward")


def add_eval_parser(sub) -> None:
    """Add ``eval`` (with ``ppl``, ``sweep``, ``states``, ``copying``, ``fixed-point``, ``harness``, ``synth``)."""
    ev = sub.add_parser("eval", help="evaluate a checkpoint: ppl|sweep|states|copying|fixed-point|harness|synth")
    esub = ev.add_subparsers(dest="eval_cmd", required=True)

    p = esub.add_parser("ppl", help="PPL: native, terminal-sharing and per-visit protocols + sharing penalty")
    _common(p, cache_choices=("terminal", "per_visit", "both"), cache_default=None)  # both; terminal with --student
    add_student_option(p)
    p.add_argument("--prefix-len", type=int, default=None,
                   help="tokens prefilled per sequence, the rest is scored (paper: 4096 of 8192; default half)")
    p.add_argument("--no-native", action="store_true", help="skip the plain parallel-forward PPL")
    add_memory_option(p)
    p.set_defaults(fn=cmd_eval_ppl)

    p = esub.add_parser("sweep", help="PPL across depths: table + PNG plot")
    _common(p, cache_choices=None)  # --sharing scores both cache modes
    p.add_argument("--depths", default="1,2,4,5,8,16,32,64", help="comma-separated depths")
    p.add_argument("--sharing", action="store_true", help="also terminal / per-visit PPL and penalty per depth, "
                   "beside the native PPL of the same tokens (after the prefix)")
    p.add_argument("--prefix-len", type=int, default=None, help="tokens prefilled by --sharing (default half)")
    p.add_argument("--plot", default=None, help="PNG path (default: next to --json, else depth_sweep.png)")
    hide_options(p, "decode_depth", "max_depth")  # refused (cmd_eval_sweep): each row decodes, and caps its depth, at R
    add_memory_option(p)
    p.set_defaults(fn=cmd_eval_sweep)

    p = esub.add_parser("states", help="depth use: per-recurrence state change, state share of the injection, "
                                       "RMS of e and h, contraction")
    _common(p, decode=False, batch=False)
    add_memory_option(p)
    next(a for a in p._actions if a.dest == "depth").help = "deepest recurrence diagnosed (default 16)"
    p.set_defaults(fn=cmd_eval_states)

    p = esub.add_parser("copying", help="in-context copying: loss on random tokens at their first occurrence "
                                        "and when repeated, per depth (megaloop.eval.copying)")
    _common(p, decode=False, data=False)
    next(a for a in p._actions if a.dest == "depth").help = ("the second of the default depths {1, R} (default: the "
                                                              "run's eval depth); refused with --depths")
    p.add_argument("--depths", default=None, help="comma-separated depths (default: 1 and the run's eval depth)")
    p.add_argument("--num-seqs", type=int, default=16, help="probe sequences")
    p.add_argument("--half-len", type=int, default=None,
                   help="random tokens per sequence, each sequence is them twice (default: half the training seq_len)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the random tokens (the same probe for every model)")
    add_memory_option(p)
    p.set_defaults(fn=cmd_eval_copying)

    p = esub.add_parser("fixed-point", help="SPEC §8: joint vs frozen-prefix fixed points")
    _common(p, decode=False, batch=False)
    p.add_argument("--per-source", type=int, default=None,
                   help="spans per validation source (default 16, the paper's 16 × 19 = 304; needs a 'source' "
                        "column; 0: the first --max-seqs rows)")
    p.add_argument("--prefix-len", type=int, default=None, help="prefix tokens per span (default seq_len-1)")
    p.add_argument("--max-steps", type=int, default=1024, help="recurrence limit per solve (<= 1024)")
    p.add_argument("--control-depth", type=int, default=5, help="depth of the finite-prefix control (0: off)")
    p.add_argument("--no-zero-init", action="store_true", help="skip the zero current-token init check")
    hide_options(p, "depth")  # refused: solves run to convergence
    add_memory_option(p)
    p.set_defaults(fn=cmd_eval_fixed_point)

    p = esub.add_parser("harness", help="lm-eval tasks (local megaloop_toy_mc and megaloop_synth shipped) with terminal sharing")
    _common(p, cache_choices=("terminal", "per_visit", "none"), data=False)
    add_student_option(p)
    p.add_argument("--tasks", required=True, help="comma-separated task names, e.g. megaloop_toy_mc")
    p.add_argument("--limit", type=float, default=None, help="examples per task (or fraction if < 1)")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=16, help="continuations per scoring pass / decode batch")
    p.add_argument("--scoring", choices=("decode", "parallel"), default=None,
                   help="loglikelihood scoring: decode (default; prefill the context at P, then one continuation "
                        "token at a time at D through the cache, as in the paper) or parallel (one pass at R; "
                        "faster; the default with --cache none)")
    p.add_argument("--include-path", action="append", default=[], help="extra folder of task YAMLs")
    p.add_argument("--include-defaults", action="store_true", help="also index lm-eval's built-in tasks")
    add_memory_option(p)
    p.set_defaults(fn=cmd_eval_harness)
    from megaloop.eval.synth_cli import add_synth_parser

    add_synth_parser(esub)


# ----------------------------------------------------------------------------- helpers
def _check_args(args: argparse.Namespace) -> None:
    """Validate cheap inputs before loading anything."""
    if getattr(args, "max_seqs", None) is not None and args.max_seqs < 1:
        raise ConfigError(f"--max-seqs: must be >= 1, got {args.max_seqs}")
    if getattr(args, "seq_len", None) is not None and args.seq_len < 4:
        raise ConfigError(f"--seq-len: must be >= 4, got {args.seq_len}")
    if getattr(args, "per_source", None) is not None and args.per_source < 0:
        raise ConfigError(f"--per-source: must be >= 0 (0: off), got {args.per_source}")
    if getattr(args, "data", None) is not None:
        from megaloop.eval.ppl import check_data_arg

        check_data_arg(args.data)
        if getattr(args, "text_field", None) is not None:
            from megaloop.eval.text_data import text_format

            if text_format(args.data) not in ("jsonl", "parquet"):
                raise ConfigError(f"--text-field: applies to a .jsonl[.gz] or .parquet --data file, not "
                                  f"{args.data} (it would be ignored)")
    check_engine_args(args)
    check_outputs_not_inputs(args, {"--json": args.json})


def _check_prefix_len(args: argparse.Namespace, engine=None) -> None:
    """``--prefix-len`` of ``eval ppl`` / ``sweep`` against the sequence length it will meet: refused
    (naming the valid range) when it leaves no target to score. Before the model loads when the
    length is known then (``--seq-len``, or an MDS set's manifest), else with ``engine``'s training
    length (the default set's and a text file's length) before the data is read."""
    from megaloop.eval.ppl import check_prefix_len

    plen = getattr(args, "prefix_len", None)
    if plen is None:
        return
    if plen < 1:
        raise ConfigError(f"--prefix-len: must be >= 1 (tokens prefilled before the scored ones), got {plen}")
    length = args.seq_len or _stored_seq_len(args.data)
    if length is None and engine is not None and not _is_remote(args.data):
        length = int(engine.config.max_position_embeddings)
    if length is not None:
        check_prefix_len(plen, int(length))


def _is_remote(data: str) -> bool:
    return "://" in str(data)


def _stored_seq_len(data: str) -> Optional[int]:
    """The sequence length an MDS set's manifest records (None: not a local MDS set, or none recorded)."""
    import json

    if data == "default" or str(data).startswith("default:") or _is_remote(data):
        return None
    try:
        value = json.loads((Path(data) / "manifest.json").read_text()).get("seq_len")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


_WARNED: set = set()


def _document_encoder(engine):
    """How a text --data file's documents are tokenised: as the data pipeline tokenises training
    documents (a special token's string in the text stays text; megaloop.data.tokenizer), else the
    engine's own ``encode``; None without a tokenizer."""
    tok = engine.tokenizer
    if tok is None:
        return None
    if callable(getattr(tok, "encode_batch", None)):
        return lambda text: tok.encode_batch([text])[0]
    return engine.encode


def _data(args: argparse.Namespace, engine, *, max_seqs: Optional[int] = -1):
    """The evaluation set of ``--data``; sequences longer than the training length raise the
    engine's context (RoPE extrapolation, warned once) unless ``--max-context`` was given."""
    from megaloop.eval.ppl import load_eval_data

    run_data = _run_data_config(engine)  # the checkpoint's RUN/config.yaml data section, read once
    data = load_eval_data(args.data, seq_len=args.seq_len, max_seqs=args.max_seqs if max_seqs == -1 else max_seqs,
                          vocab_size=engine.vocab_size, default_seq_len=engine.config.max_position_embeddings,
                          encode=_document_encoder(engine), eos_id=engine.eos_id,
                          text_field="text" if args.text_field is None else args.text_field, tokenizer_sha256=getattr(engine.tokenizer, "sha256s", None),
                          tokenizer_hint=_own_val_hint(args.data, engine, run_data),
                          tokenizer_given=getattr(args, "tokenizer", None))
    from megaloop.eval.states import input_positions

    data.inputs = input_positions(data.loss_mask)  # before the boundary mask below, which zeroes real inputs
    if engine.eos_id is not None and run_data.get("mask_document_boundaries") is True:
        # scored as the run trained and validated: no loss on the token after an EOS (it was counted,
        # so `eval ppl` differed from the run's own val_ppl on the same sequences)
        data.loss_mask = data.loss_mask * (data.tokens != int(engine.eos_id)).to(data.loss_mask.dtype)
        if "mask" not in _WARNED:
            _WARNED.add("mask")
            print("note: the run trained with data.mask_document_boundaries=true: the token after each EOS is "
                  "not scored, as in its validation", file=sys.stderr)
    trained = int(engine.config.max_position_embeddings)
    if data.seq_len > engine.max_context and args.max_context is None:
        engine.max_context = data.seq_len
    engine.check_context(data.seq_len, "evaluation sequence")  # a --max-context below it, in every verb
    if data.seq_len > trained and (trained, data.seq_len) not in _WARNED:
        _WARNED.add((trained, data.seq_len))
        print(f"warning: {data.seq_len}-token sequences exceed the training seq_len {trained}: RoPE positions "
              f"{trained}..{data.seq_len - 1} were never trained and are extrapolated", file=sys.stderr)
    return data


def _run_data_config(engine) -> dict:
    """The ``data`` section of the checkpoint's ``RUN/config.yaml``; {} for an HF folder or no run."""
    if (getattr(engine, "source", None) or {}).get("kind") != "checkpoint":
        return {}
    import yaml

    from megaloop.hf.convert import run_dir_of

    try:
        cfg = yaml.safe_load((run_dir_of(Path(engine.source["path"])) / "config.yaml").read_text())
        return (cfg.get("data") or {}) if isinstance(cfg, dict) else {}
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return {}


def _own_val_hint(data: str, engine, run_data: dict) -> Optional[str]:
    """For the embedded default set (``--data`` not given): the run's own validation set
    (``data.val_path`` of ``run_data``, the checkpoint's ``RUN/config.yaml`` data section) as ``--data PATH``, None when the
    checkpoint is no run or its config sets none. Offered when the default set's tokenizer is not
    the checkpoint's."""
    if data != "default":
        return None
    val = run_data.get("val_path")
    if not val or not isinstance(val, str):
        return None
    from megaloop.data.tokenizer import find_relative
    from megaloop.hf.convert import run_dir_of

    run = run_dir_of(Path(engine.source["path"]))
    local = not (val.startswith("default") or _is_remote(val))
    found = find_relative(val, run, lambda p: (p / "manifest.json").is_file()) if local else None
    return f"evaluate on the run's own validation set: --data {found or val} (data.val_path in {run / 'config.yaml'})"


def _memory_check(args: argparse.Namespace, engine, data, depths, protocols) -> None:
    """Refuse (ConfigError) a batch the device cannot hold, before the first forward."""
    if args.no_memory_check:
        return
    from megaloop.eval.memory import check_eval_memory
    from megaloop.inference.kv_cache import check_depth

    L = data.seq_len
    plen = args.prefix_len if args.prefix_len is not None else L // 2
    if args.batch_size < 1 or not 1 <= plen < L:
        return  # the evaluation refuses these itself, naming the flag
    pdepth = check_depth(args.prefill_depth, "--prefill-depth") if args.prefill_depth is not None else None
    check_eval_memory(engine, batch_size=min(args.batch_size, data.num_seqs), seq_len=L, prefix_len=plen,
                      depths=[check_depth(d, "--depth") for d in depths], prefill_depth=pdepth, protocols=protocols)


# ----------------------------------------------------------------------------- commands
def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from megaloop.eval.ppl import evaluate_ppl, protocols_for

    if args.cache is None:  # both protocols; with --student the one its prefill serves
        args.cache = "terminal" if args.student else "both"
    if args.decode_depth is not None and args.exit is None:
        raise ConfigError("--decode-depth: eval ppl scores the second half in one parallel pass at --depth "
                          "(SPEC §7), not token by token; drop it (with --exit it is the default --max-depth)")
    _check_args(args)
    _check_prefix_len(args)
    protocols = protocols_for(args.cache, native=not args.no_native)
    engine = build_engine(args)
    _check_prefix_len(args, engine)
    data = _data(args, engine)
    _memory_check(args, engine, data, [args.depth or engine.depth], protocols)
    res = evaluate_ppl(engine, data, depth=args.depth, prefill_depth=args.prefill_depth, protocols=protocols,
                       batch_size=args.batch_size, prefix_len=args.prefix_len)
    rows = []
    if res.native_ppl is not None:
        rows.append(["native (all positions)", res.native_ppl, res.tokens_native, "—"])
        rows.append(["native (second half)", res.native_ppl_second_half, res.tokens_scored, "—"])
    for mode in ("terminal", "per_visit"):
        value = getattr(res, f"{mode}_ppl")
        if value is not None:
            at = "by the student" if args.student else f"at P={res.prefill_depth}"  # it printed P=3 for a student
            rows.append([f"{mode} cache (prefill {res.prefix_len} {at})", value, res.tokens_scored,
                         res.kv_bytes_per_token[mode]])
    table(f"PPL at R={res.depth} — {data.num_seqs} × {data.seq_len} tokens, first {res.prefix_len} prefilled "
          f"({data.source})",
          ["protocol", "PPL", "tokens", "KV bytes/token"], rows)
    if res.sharing_penalty_pct is not None and not engine.config.looped:  # one pass: nothing is shared
        print(f"sharing penalty: none (an untied model has one pass, so the terminal and per-visit caches are "
              f"the same; {res.sharing_penalty_pct:+.4f} %)")
    elif res.sharing_penalty_pct is not None:
        print(f"sharing penalty 100·(PPL_terminal/PPL_fullKV − 1) = {res.sharing_penalty_pct:+.4f} %")
    for mode, stats in (res.adaptive_depths or {}).items():
        print(f"adaptive decode ({stats['criterion']}, {mode} cache, second half scored token by token): "
              f"{depth_summary(stats)}")
    write_json(args.json, {"command": "eval ppl", "engine": engine.describe(), "data": data.source, **res.to_dict(),
                            **({"prefill_depth": None, "prefill": "student"} if args.student else {})})
    return 0


def cmd_eval_sweep(args: argparse.Namespace) -> int:
    from megaloop.eval.depth_sweep import depth_sweep, parse_depths, plot_sweep

    if args.decode_depth is not None:
        raise ConfigError("--decode-depth: eval sweep decodes each row at its own depth (--depths); drop it")
    if args.max_depth is not None:
        raise ConfigError("--max-depth: eval sweep caps each row's adaptive depth at its own depth (--depths); "
                          "drop it")
    if args.exit and args.sharing:  # each row's cap is its own R (row_policy): the engine's policy admits the deepest
        args.max_depth = max(max(parse_depths(args.depths)), args.depth or 0,
                             args.min_depth if args.min_depth is not None else 2)
    _check_args(args)
    if not args.sharing:
        for flag, value in (("--prefill-depth", args.prefill_depth), ("--exit", args.exit),
                            ("--min-depth", args.min_depth), ("--max-depth", args.max_depth),
                            ("--prefix-len", args.prefix_len)):
            if value is not None:
                raise ConfigError(f"{flag}: applies to the prefill/decode protocols of --sharing; add --sharing "
                                  f"(native PPL is one parallel forward at each depth)")
    depths = parse_depths(args.depths)
    from megaloop.inference.generate_cli import is_untied

    if is_untied(args):
        raise ConfigError(f"eval sweep: {args.checkpoint} is an untied (non-looped) model, it has no depth to sweep "
                          "(use eval ppl)")
    plot = check_plot_path(args.plot, args.json, "depth_sweep.png")
    check_outputs_not_inputs(args, {"--json": args.json, "--plot": str(plot)})
    _check_prefix_len(args)
    engine = build_engine(args)
    _check_prefix_len(args, engine)
    data = _data(args, engine)
    _memory_check(args, engine, data, depths + [engine.depth],
                  ("native", "terminal", "per_visit") if args.sharing else ("native",))
    res = depth_sweep(engine, data, depths, sharing=args.sharing, prefill_depth=args.prefill_depth,
                      batch_size=args.batch_size, prefix_len=args.prefix_len)
    keys = ["native_ppl"] + ["native_ppl_second_half", "terminal_ppl", "per_visit_ppl", "sharing_penalty_pct"] * args.sharing
    cols = ["R", "native PPL" + " (all)" * args.sharing] + ["native (2nd half)", "terminal PPL", "per-visit PPL",
                                                           "penalty %"] * args.sharing  # the caches' tokens: 2nd half
    table(f"PPL vs depth — {data.num_seqs} × {data.seq_len} tokens", cols, [[r["depth"]] + [r[k] for k in keys]
                                                                            for r in res["rows"]])
    for r in res["rows"]:
        for mode, stats in (r.get("adaptive_depths") or {}).items():
            print(f"R={r['depth']} adaptive decode ({stats['criterion']}, max depth {stats['max_depth']}, {mode} "
                  f"cache): {depth_summary(stats)}")
    what = ("extrapolation" if res["deepest"] > res["reference_depth"] else
            f"no extrapolation (the deepest swept R={res['deepest']} is not past the reference R="
            f"{res['reference_depth']})")
    print(f"{what}: PPL(R={res['deepest']}) / PPL(R={res['reference_depth']}) − 1 = "
          f"{res['extrapolation_pct']:+.3f} %")
    res["plot"] = str(plot)
    res.update(lengths(engine, data.seq_len))
    write_json(args.json, {"command": "eval sweep", "engine": engine.describe(), "data": data.source, **res})
    print(f"wrote {plot_sweep(res, plot)}")  # after the JSON: a failing plot loses no result
    return 0


def cmd_eval_states(args: argparse.Namespace) -> int:
    """Per-recurrence depth-use diagnostics (megaloop.eval.states) on the first --max-seqs (16)
    sequences of --data at --depth (default 16), evaluation-time state init."""
    from megaloop.eval.states import format_table, trace_diagnostics

    _check_args(args)
    engine = build_engine(args)
    if not engine.config.looped:
        raise ConfigError(f"--checkpoint {args.checkpoint}: an untied model has no recurrence to diagnose")
    data = _data(args, engine, max_seqs=args.max_seqs or 16)
    depth = args.depth or 16
    if not args.no_memory_check:
        from megaloop.eval.memory import check_trace_memory

        check_trace_memory(engine, num_seqs=data.num_seqs, seq_len=data.seq_len, depth=depth)
    ids = data.tokens.to(engine.device)
    # the input tokens, not the scored targets: the loss mask left each row's last token out
    diag = trace_diagnostics(engine.model, ids, depth, mask=data.inputs.to(engine.device))
    table(f"Recurrence diagnostics at R={depth} — {data.num_seqs} × {data.seq_len} tokens, "
          f"RMS(e) = {fmt(diag['rms_e'])}",
          ["r", "‖h^r−h^(r−1)‖/‖h^r‖", "state share of injection", "RMS h^r", "contraction"], format_table(diag))
    write_json(args.json, {"command": "eval states", "engine": engine.describe(), "data": data.source,
                            "depth": depth, "num_seqs": data.num_seqs, **lengths(engine, data.seq_len), **diag})
    return 0


def cmd_eval_copying(args: argparse.Namespace) -> int:
    """In-context copying probe (megaloop.eval.copying) at each of --depths: cross-entropy of
    --num-seqs sequences of --half-len random ids (special tokens left out) at their first
    occurrence and when repeated, and the copy gain between them (nats)."""
    from megaloop.eval.copying import copy_probe
    from megaloop.eval.depth_sweep import parse_depths

    if args.num_seqs < 1:
        raise ConfigError(f"--num-seqs: must be >= 1, got {args.num_seqs}")
    if args.half_len is not None and args.half_len < 2:
        raise ConfigError(f"--half-len: must be >= 2, got {args.half_len}")
    depths = parse_depths(args.depths) if args.depths is not None else None  # "" is refused, not the default
    if depths is not None and args.depth is not None:
        raise ConfigError(f"--depth: eval copying runs the depths of --depths only ({args.depths}); --depth sets the "
                          "second of the default depths {1, R}: drop one of them")
    _check_args(args)
    engine = build_engine(args)
    half = args.half_len or int(engine.config.max_position_embeddings) // 2
    if 2 * half > engine.max_context:
        raise ConfigError(f"--half-len: {half} random tokens twice ({2 * half}) exceed the context "
                          f"{engine.max_context} (pass --max-context to extrapolate RoPE)")
    looped = bool(engine.config.looped)
    if not looped and depths:
        raise ConfigError(f"--depths: {args.checkpoint} is an untied (non-looped) model, it has no depth to vary")
    depths = depths or (sorted({1, engine.depth}) if looped else [None])
    trained = int(engine.config.max_position_embeddings)
    if 2 * half > trained:
        print(f"warning: {2 * half}-token sequences exceed the training seq_len {trained}: RoPE positions "
              f"{trained}..{2 * half - 1} were never trained and are extrapolated", file=sys.stderr)
    if not args.no_memory_check:
        from megaloop.eval.memory import check_copy_memory

        check_copy_memory(engine, num_seqs=args.num_seqs, half_len=half)
    tok = engine.tokenizer
    special = {i for i in (engine.eos_id, getattr(tok, "bos_id", None), getattr(tok, "pad_id", None),
                           engine.config.pad_token_id) if i is not None} | set(getattr(tok, "special_ids", ()))
    # every special token, not the three named ones alone: an export names its EOS as its BOS too
    model = engine.model.eval()
    rows, res = [], {}
    for r in depths:  # copy_probe runs without gradients
        kw = {"num_recurrences": r} if looped else {}
        out = copy_probe(lambda ids: model(input_ids=ids.to(engine.device), **kw).logits,
                         engine.vocab_size, num_seqs=args.num_seqs, half_len=half, seed=args.seed,
                         exclude=sorted(special))
        res[str(r)] = out
        rows.append([r, out["loss_first"], out["loss_repeat"], out["copy_gain"]])
    table(f"In-context copying — {args.num_seqs} × {half} random tokens, repeated once",
          ["R", "CE first (nats)", "CE repeat (nats)", "copy gain (nats)"], rows)
    write_json(args.json, {"command": "eval copying", "engine": engine.describe(), "half_len": half,
                           "num_seqs": args.num_seqs, "seed": args.seed, "excluded_ids": sorted(special),
                           **lengths(engine, 2 * half), "depths": res})
    return 0


def cmd_eval_fixed_point(args: argparse.Namespace) -> int:
    from megaloop.inference.fixed_point import Criteria, fixed_point_report, select_per_source

    _check_args(args)
    if args.depth is not None:  # the solves run to convergence, not to a depth
        raise ConfigError("--depth: eval fixed-point iterates each span to its fixed point (at most --max-steps); "
                          "--control-depth sets the fixed-depth control")
    if args.dtype != "fp32":
        raise ConfigError(f"--dtype {args.dtype}: eval fixed-point solves in FP32 (SPEC §8); drop --dtype")
    criteria = Criteria(max_steps=args.max_steps)
    if args.control_depth < 0:
        raise ConfigError(f"--control-depth: must be >= 0, got {args.control_depth}")
    engine = build_engine(args, dtype="fp32")  # SPEC §8: FP32, reference attention
    if not engine.config.looped:
        raise ConfigError("fixed-point checks need a looped model (arch=looped)")
    per_source = args.per_source
    data = _data(args, engine, max_seqs=None if per_source != 0 else (args.max_seqs or 4))
    if data.sources is None and per_source:
        raise ConfigError(f"--per-source: {data.source} has no 'source' column (pass --per-source 0 to take "
                          f"the first --max-seqs rows)")
    if data.sources is None:  # no source column, --per-source not given: the first rows
        per_source = 0
        print(f"note: {data.source} has no 'source' column: taking its first {args.max_seqs or 4} rows",
              file=sys.stderr)
    plen = args.prefix_len if args.prefix_len is not None else data.seq_len - 1
    if not 1 <= plen <= data.seq_len - 1:
        raise ConfigError(f"--prefix-len: must be in [1, {data.seq_len - 1}], got {plen}")
    if per_source != 0:
        per_source = per_source or 16
        rows_idx = select_per_source(data.sources, per_source, args.max_seqs)
        sources = [data.sources[i] for i in rows_idx]
    else:
        rows_idx = list(range(min(data.num_seqs, args.max_seqs or 4)))
        sources = [data.sources[i] for i in rows_idx] if data.sources is not None else None
    if not args.no_memory_check:
        from megaloop.eval.memory import check_fixed_point_memory

        check_fixed_point_memory(engine, prefix_len=plen, cycle_window=criteria.cycle_window)
    spans = data.tokens[rows_idx, :plen + 1]
    rep = fixed_point_report(engine.model, spans, criteria, control_depth=args.control_depth or None,
                             zero_init=not args.no_zero_init, sources=sources)
    rows = [["spans qualified (prefix, joint, current all qualify)", f"{rep['num_qualified']} / {rep['num_spans']}"]]
    for k in ("prefix", "joint", "current"):
        d = rep["depth"][k]
        rows.append([f"{k} solve depth median / max", f"{fmt(d['median'])} / {fmt(d['max'])}"])
    rows.append(["relative state gap joint vs frozen-prefix median / max",
                 f"{fmt(rep['state_gap']['median'])} / {fmt(rep['state_gap']['max'])}"])
    rows.append(["prediction KL(joint ‖ frozen) median / max", f"{fmt(rep['kl']['median'])} / {fmt(rep['kl']['max'])}"])
    if "zero_init_state_gap" in rep:
        rows.append(["state gap from zero current-token init (max)", fmt(rep["zero_init_state_gap"]["max"])])
    if "control" in rep:
        c = rep["control"]
        rows.append([f"control: depth-{c['depth']} prefix state gap median / max",
                     f"{fmt(c['state_gap']['median'])} / {fmt(c['state_gap']['max'])}"])
    for k, reasons in rep["rejections"].items():
        for reason, n in reasons.items():
            rows.append([f"rejected {k} solves: {reason}", n])
    table(f"Fixed points (prefix {plen} + 1 current token, ≤ {criteria.max_steps} recurrences, FP32, math attention)",
          ["check", "value"], rows)
    if "per_source" in rep:
        cap = f", {len(rows_idx)} in all by --max-seqs {args.max_seqs}" if args.max_seqs else ""
        table(f"Fixed points per source (up to {per_source} spans per source{cap})",
              ["source", "spans", "qualified", "joint depth median", "state gap median / max", "KL median / max"],
              [[name, r["num_spans"], r["num_qualified"], r["depth"]["joint"]["median"],
                f"{fmt(r['state_gap']['median'])} / {fmt(r['state_gap']['max'])}",
                f"{fmt(r['kl']['median'])} / {fmt(r['kl']['max'])}"] for name, r in rep["per_source"].items()])
    write_json(args.json, {"command": "eval fixed-point", "engine": engine.describe(), "data": data.source,
                            "prefix_len": plen, "per_source_k": per_source or None, **rep})
    return 0


def cmd_eval_harness(args: argparse.Namespace) -> int:
    from megaloop.eval.decode_score import check_scoring
    from megaloop.eval.harness import MegaloopLM, check_task_inputs, resolve_tasks, run_harness

    if args.limit is not None and not (args.limit.is_integer() and args.limit >= 1 or 0 < args.limit < 1):
        raise ConfigError(f"--limit: must be a whole number >= 1 (examples per task) or a fraction in (0, 1), "
                          f"got {args.limit:g}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ConfigError(f"--num-fewshot: must be >= 0, got {args.num_fewshot}")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size: must be >= 1, got {args.batch_size}")
    _check_args(args)
    scoring = check_scoring(args.scoring or ("parallel" if args.cache == "none" else "decode"), args.cache)
    _warn_generate_only_options(args, scoring)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    resolved = resolve_tasks(tasks, args.include_path, args.include_defaults)  # before loading the model
    check_task_inputs(resolved[1], args.include_path, {"--json": args.json})
    engine = build_engine(args, cache_mode="per_visit" if args.cache == "per_visit" else "terminal")
    lm = MegaloopLM(engine, depth=args.depth, prefill_depth=args.prefill_depth, decode_depth=args.decode_depth,
                    cache_mode=args.cache, scoring=args.scoring, batch_size=args.batch_size,
                    memory_check=not args.no_memory_check)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    res = run_harness(lm, tasks, limit=limit, num_fewshot=args.num_fewshot, resolved=resolved)
    rows = []
    for task, metrics in res["results"].items():
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and k != "sample_len":
                rows.append([task, k, v, metrics.get("sample_len")])
    c = res["config"]
    policy = lm.policy
    if c["scoring"] != "decode":
        how = f"R={c['depth']} parallel"
    elif policy is not None:
        how = f"adaptive depth token by token ({policy.spec}, depth {policy.min_depth}..{policy.max_depth})"
    else:
        how = f"D={c['decode_depth']} token by token"
    if args.student:  # the student prefills: the prefill depth is unused (it printed and recorded the default)
        c.update(prefill_depth=None, prefill="student")
    table(f"lm-eval ({c['cache_mode']} cache, P={c.get('prefill') or c['prefill_depth']}, {how})",
          ["task", "metric", "value", "n"], rows)
    extra = {}
    if policy is not None:  # every adaptive decode step of the run (scoring and generate_until)
        extra["adaptive_depths"] = {"criterion": policy.spec, "min_depth": policy.min_depth,
                                    "max_depth": policy.max_depth, **engine.depth_log.to_dict()}
        print(f"adaptive decode ({policy.spec}, max depth {policy.max_depth}): {engine.depth_log.summary()}")
    write_json(args.json, {"command": "eval harness", "engine": engine.describe(), **res, **extra})
    return 0


def _warn_generate_only_options(args: argparse.Namespace, scoring: str) -> None:
    """With parallel scoring, loglikelihood requests decode nothing token by token: the decode and
    adaptive-depth options (and, with ``--cache none``, the prefill depth) reach only the tasks'
    generate_until requests, which cannot be known before the tasks load; say so in one line."""
    if scoring != "parallel":
        return
    given = [flag for flag, on in (("--exit", args.exit is not None), ("--min-depth", args.min_depth is not None),
                                   ("--max-depth", args.max_depth is not None),
                                   ("--finished-rows", args.finished_rows != "mask"),
                                   ("--decode-depth", args.decode_depth is not None),
                                   ("--prefill-depth", args.cache == "none" and args.prefill_depth is not None))
             if on]
    if given:
        how = "--cache none" if args.cache == "none" else "--scoring parallel"
        print(f"warning: {', '.join(given)}: with {how} loglikelihood requests are scored in one parallel pass at R, "
              "so these apply only to generate_until requests", file=sys.stderr)


__all__ = ["add_eval_parser", "cmd_eval_copying", "cmd_eval_fixed_point", "cmd_eval_harness", "cmd_eval_ppl", "cmd_eval_states",
           "cmd_eval_sweep"]
