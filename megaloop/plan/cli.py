"""``megaloop plan``: memory per rank, step time, bubble and MFU of a layout before the cluster runs it.

    megaloop plan --config L --cluster h100 --gpus 64 --tp 2 --pp 4 [KEY=VALUE ...]
    megaloop plan --config M --gpus 64 --search            # ranked layouts that fit
    megaloop plan --config S --gpus 16 --preflight ...     # one line; exit 2 if predicted not to fit

The layout comes from the config (``parallel.*``, ``train.micro_batch_size``, ``model.recompute``,
``model.fp8``) and the flags below, which are shorthands for those overrides; ``cluster.KEY=VALUE``
overrides edit the cluster description. All numbers are predictions: the GPU constants of the cost
model (efficiencies, latencies, reserve, fragmentation) are assumptions until a GPU run calibrates
them (tools/gpu_check.sh records what they need). Exit 2 with one line naming the field on bad input,
before any compute; ``--search`` exits 2 as well when no layout fits (the line says what excluded
them), as ``--preflight`` does for a layout predicted not to fit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from megaloop.config_utils import ConfigError
from megaloop.errors import UserError, report

DEFAULT_VOCAB = 65536  # the README's presets table; model.vocab_size=0 means "from the tokenizer"
DEFAULT_STEPS = 32  # sampled optimizer steps, one layout and --search alike


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megaloop plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="S", help="preset name or YAML path (as megaloop train; default S)")
    p.add_argument("--arm", default=None, help="a paper arm (megaloop/configs/arms.yaml)")
    p.add_argument("--cluster", default="h100",
                   help="h100 | h200 | b200 | a YAML path | auto (this machine's GPU; preflight skips without one)")
    p.add_argument("--gpus", type=int, default=None, help="world size (default: --nodes x GPUs per node)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: the cluster description's)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (world = tp x pp x dp)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (with --search: held fixed)")
    p.add_argument("--pp", type=int, default=None, help="pipeline-parallel size (with --search: held fixed)")
    p.add_argument("--vpp", type=int, default=None,
                   help="model chunks per pipeline rank (interleaved 1F1B; with --search: held fixed)")
    p.add_argument("--mbs", type=int, default=None, help="micro-batch size (with --search: held fixed)")
    p.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=None,
                   help="activation recomputation (with --search: held fixed)")
    p.add_argument("--dist-opt", action=argparse.BooleanOptionalAction, default=None,
                   help="distributed optimizer (optimizer state sharded over DP)")
    p.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                   help="sequence parallelism (with --search: held fixed)")
    p.add_argument("--fp8", default=None, help="hybrid | e4m3 | none")
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary size when model.vocab_size is 0 (default: the data's tokenizer where the planner "
                        f"can read it: data.path=default or a local MDS folder's manifest.json; else {DEFAULT_VOCAB})")
    p.add_argument("--steps", type=int, default=None,
                   help=f"sampled optimizer steps (>= 1; default {DEFAULT_STEPS})")
    p.add_argument("--search", action="store_true",
                   help="rank the layouts (TP, PP, VPP, micro-batch, recompute, SP) that fit on --gpus; "
                        "layout flags given with it are held fixed")
    p.add_argument("--top", type=int, default=None, help="--search: layouts listed (>= 1; default 10)")
    p.add_argument("--min-pp", type=int, default=None,
                   help="--search: only layouts with at least this pipeline size (default 1)")
    p.add_argument("--microbatch-sweep", action="store_true",
                   help="bubble with sampled vs fixed depth as the microbatch count grows (same layout)")
    p.add_argument("--preflight", action="store_true",
                   help="memory check only; one line (a JSON object with --json); exit 2 if predicted not to fit")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--json-out", default=None, help="also write the JSON report to this file (atomically)")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides; cluster.KEY=VALUE edits the cluster")
    return p


def _check_flags(args) -> None:
    """Flag values and combinations, before anything is loaded (ConfigError naming the flag)."""
    for flag in ("gpus", "nodes", "dp", "tp", "pp", "vpp", "mbs", "vocab", "steps", "top", "min_pp"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ConfigError(f"--{flag.replace('_', '-')}: must be >= 1, got {v}")
    if not args.search:
        for flag in ("top", "min_pp"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')}: only applies to --search")
    if args.preflight:
        for flag, given in (("search", args.search), ("microbatch-sweep", args.microbatch_sweep),
                            ("steps", args.steps is not None)):
            if given:
                raise ConfigError(f"--preflight: checks one layout's worst-case memory and samples no steps; "
                                  f"drop --{flag} (or --preflight)")
    if args.search and args.microbatch_sweep:
        raise ConfigError("--microbatch-sweep: sweeps one layout; drop --search (and give the layout --search found)")
    if args.search and args.pp is not None and args.min_pp is not None and args.pp < args.min_pp:
        raise ConfigError(f"--min-pp: {args.min_pp} excludes the --pp {args.pp} the search is held to")
    if args.json_out is not None:
        inputs = {"--config": args.config, "--cluster": args.cluster}
        for flag, given in inputs.items():  # the command's own input files were overwritten
            if given and Path(given).is_file() and Path(given).resolve() == Path(args.json_out).resolve():
                raise ConfigError(f"--json-out: {args.json_out} is the {flag} file this command reads; give another path")
        _check_json_out(args.json_out)


def _check_json_out(path: str) -> None:
    p = Path(path)
    if not path.strip():
        raise ConfigError("--json-out: empty; give a file path")
    if p.is_dir() or path.endswith(os.sep):
        raise ConfigError(f"--json-out: {path!r} is a directory; give a file path")
    parent = p.parent
    if not parent.is_dir():
        raise ConfigError(f"--json-out: folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--json-out: folder {parent} is not writable")
    if p.exists() and not p.is_file():
        raise ConfigError(f"--json-out: {path} exists and is not a regular file")
    if p.is_file() and p.stat().st_size:  # replace an earlier report, not another file (a metrics.jsonl, a YAML)
        try:
            earlier = json.loads(p.read_text())
        except (OSError, ValueError):
            earlier = None
        if not is_plan_report(earlier):  # any JSON object was taken: a tokenizer.json, a checkpoint's megaloop.json
            raise ConfigError(f"--json-out: {path} exists and is not a JSON report (an earlier --json-out); "
                              "give a new path")


def is_plan_report(obj) -> bool:
    """Whether ``obj`` (parsed JSON) is a report this command writes: a ``--search`` report (``plans``
    + ``excluded``) or a plan / ``--preflight`` report (``layout`` + ``layout_text`` + ``cluster``)."""
    if not isinstance(obj, dict):
        return False
    return {"plans", "excluded"} <= obj.keys() or {"layout", "layout_text", "cluster"} <= obj.keys()


def _cluster(args, cluster_ov: list[str]):
    """The cluster description and whether ``auto`` found no GPU here (``auto`` = this machine's
    GPU; without one, the shipped h100 with the overrides: there is nothing to plan on, but the
    overrides and flags are still checked against it)."""
    from megaloop.plan.cluster import device_cluster, load_cluster

    name = args.cluster
    if name.strip().lower() == "auto":
        import torch

        if not torch.cuda.is_available():
            return load_cluster("h100", cluster_ov), True
        gpu = torch.cuda.get_device_name(0)
        mem = torch.cuda.get_device_properties(0).total_memory / 2**30
        return device_cluster(gpu, [f"gpu={gpu.replace(' ', '_')}", f"gpu_memory_gib={mem:.1f}", *cluster_ov])[0], False
    return load_cluster(name, cluster_ov), False


def resolve_vocab(cfg, flag: int | None) -> tuple[int, str]:
    """The vocabulary to plan and where it came from, as ``megaloop train`` would take it:
    ``model.vocab_size``, else ``--vocab``, else the data's tokenizer (``data.path=default``: the
    embedded corpus's; a local MDS folder: its ``manifest.json``'s ``vocab_size``), else
    :data:`DEFAULT_VOCAB`. A ``model.vocab_size`` below the data's tokenizer is refused, as
    ``megaloop train`` refuses it. Nothing is built or downloaded."""
    data_v, data_source = _data_vocab(cfg.data.path)
    model_v = cfg.model.vocab_size
    if model_v:
        if flag is not None and flag != model_v:
            raise ConfigError(f"--vocab: {flag} contradicts the config's model.vocab_size={model_v}; give one of them")
        if data_v is not None and model_v < data_v:
            raise ConfigError(f"model.vocab_size: {model_v} is smaller than the tokenizer's {data_v} ({data_source})")
        return model_v, "model.vocab_size"
    if flag is not None:
        return flag, "--vocab"
    if data_v is None:
        return DEFAULT_VOCAB, data_source
    return data_v, data_source


def _data_vocab(path: str) -> tuple[int | None, str]:
    """``(vocab, source)`` of the data's tokenizer where it can be read here, else ``(None, why)``."""
    if path == "default" or path.startswith("default:"):
        from megaloop.data.default_tokenizer import DEFAULT_VOCAB_SIZE

        return DEFAULT_VOCAB_SIZE, "data.path=default: the embedded corpus's tokenizer"
    if "://" in path:
        return None, f"default; data.path={path} is remote and not read here (--vocab N to set it)"
    manifest = Path(path) / "manifest.json"
    if not manifest.is_file():
        return None, f"default; no {manifest} here (--vocab N to set it)"
    try:
        v = json.loads(manifest.read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"data.path: cannot read {manifest}: {err}") from None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        return None, f"default; {manifest} gives no vocab_size (--vocab N to set it)"
    return v, f"data.path: {manifest}"


def _cluster_mapping(text: str) -> list[str]:
    """``cluster={gpu_memory_gib: 94, ...}`` as ``cluster.KEY=VALUE`` overrides (the section-mapping
    form the config's sections take)."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = None
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"cluster: expected a mapping such as cluster={{gpu_memory_gib: 94}}, got {text!r}")
    return [f"cluster.{k}={json.dumps(v)}" for k, v in value.items()]  # JSON is YAML: null stays null


def _inputs(args):
    from megaloop.config import load_config
    from megaloop.plan.layout import layout_overrides

    cluster_ov, overrides = [], []
    for o in args.overrides:  # in order: a later edit of a field wins, in either form
        if o.startswith("cluster."):
            cluster_ov.append(o)
        elif o.partition("=")[0].strip() == "cluster":
            cluster_ov += _cluster_mapping(o.partition("=")[2])
        else:
            overrides.append(o)
    flags = layout_overrides(args.tp, args.pp, args.vpp, args.mbs, args.recompute, args.dist_opt, args.fp8, args.sp)
    cluster, no_gpu = _cluster(args, cluster_ov)
    _check_flags_against_overrides(overrides, flags)
    cfg = load_config(args.config, overrides + flags, arm=args.arm)
    overrides += flags
    cfg.check_trainable()
    vocab, source = resolve_vocab(cfg, args.vocab)
    if not no_gpu:
        cluster.peak_tflops(bool(cfg.model.fp8))  # an FP8 layout on a GPU without an FP8 peak
    return cfg, overrides, cluster, no_gpu, vocab, source


# config key -> the layout flag that sets it (megaloop.plan.layout.layout_overrides)
_FLAG_KEYS = {"parallel.tp": "--tp", "parallel.pp": "--pp", "parallel.vpp": "--vpp", "train.micro_batch_size": "--mbs",
              "model.recompute": "--recompute", "parallel.distributed_optimizer": "--dist-opt",
              "parallel.sequence_parallel": "--sp", "model.fp8": "--fp8"}


def _check_flags_against_overrides(overrides: list[str], flags: list[str]) -> None:
    """A layout flag and a KEY=VALUE override of its key that disagree (``--tp 2 parallel.tp=4``) are refused,
    as ``--vocab`` against ``model.vocab_size`` is; agreeing ones pass. Values compare as a config reads them
    (the override's last value for its key), with no second config load."""
    from megaloop.config_utils import apply_dotlist, dotlist_settings

    given = {k: v for k, v in dotlist_settings(overrides).items() if k in _FLAG_KEYS and v is not None}
    for key, value in dotlist_settings(flags).items():
        if key not in given:
            continue
        section, field = key.split(".")
        ours, theirs = (apply_dotlist({}, [f"{key}={v}"])[section][field] for v in (value, given[key]))
        if key == "model.fp8" and isinstance(theirs, str) and theirs.lower() in ("", "none", "off"):
            theirs = None
        if ours != theirs or isinstance(ours, bool) != isinstance(theirs, bool):
            flag = _FLAG_KEYS[key]
            said = (f"--{'' if ours else 'no-'}{flag[2:]}" if isinstance(ours, bool)
                    else f"{flag} {'none' if ours is None else ours}")
            shown = "null" if theirs is None else str(theirs).lower() if isinstance(theirs, bool) else theirs
            raise ConfigError(f"{flag}: {said} contradicts the override {key}={shown}; give one of them")


def _world(args, cfg, cluster) -> int:
    """The world size the flags give; one that spills over whole nodes unevenly is refused (a launch runs the
    same number of processes on every node; fewer GPUs than one node holds is one partly used node)."""
    world, gpn = _world_size(args, cfg, cluster), cluster.gpus_per_node
    if world > gpn and world % gpn:
        field, how = ("--gpus", "") if args.gpus is not None else ("--dp", f" (tp x pp x dp {args.dp})")
        raise ConfigError(f"{field}: {world} GPUs{how} do not fill whole nodes of {gpn} (cluster.gpus_per_node): "
                          "every node runs the same number of processes")
    return world


def _world_size(args, cfg, cluster) -> int:
    gpn = cluster.gpus_per_node
    by_nodes = args.nodes * gpn if args.nodes is not None else None
    if args.gpus is not None and by_nodes is not None and args.gpus != by_nodes:
        raise ConfigError(f"--gpus: {args.gpus} GPUs contradict --nodes {args.nodes} ({args.nodes} x {gpn} GPUs per "
                          f"node = {by_nodes}); give one of them")
    world = args.gpus if args.gpus is not None else by_nodes
    if args.dp is not None:
        if args.search:
            if world is None:
                raise ConfigError("--dp: --search needs the world size: give --gpus or --nodes")
            if world % args.dp:
                raise ConfigError(f"--dp: {world} GPUs are not divisible by --dp {args.dp}")
            return world
        by_dp = cfg.parallel.tp * cfg.parallel.pp * args.dp
        if world is not None and world != by_dp:
            given = f"--gpus {args.gpus}" if args.gpus is not None else f"--nodes {args.nodes} ({by_nodes} GPUs)"
            raise ConfigError(f"--dp: tp x pp x dp = {by_dp} but {given}")
        return by_dp
    return world if world is not None else cluster.nodes * gpn


# config keys the search varies -> how a held value reads from the loaded config
_HELD = {"parallel.tp": ("tp", lambda c: c.parallel.tp), "parallel.pp": ("pp", lambda c: c.parallel.pp),
         "parallel.vpp": ("vpp", lambda c: c.parallel.vpp or 1),
         "train.micro_batch_size": ("mbs", lambda c: c.train.micro_batch_size),
         "model.recompute": ("recompute", lambda c: c.model.recompute),
         "parallel.sequence_parallel": ("sp", lambda c: c.parallel.sequence_parallel)}


def _held(args, cfg, overrides: list[str]) -> dict:
    """Layout knobs the user fixed (a flag or a KEY=VALUE override of a searched key): the search
    holds them at the config's value instead of overriding them."""
    keys = {o.split("=", 1)[0].strip() for o in overrides if "=" in o}
    held = {name: get(cfg) for key, (name, get) in _HELD.items() if key in keys}
    if args.dp is not None:
        held["dp"] = args.dp
    return held


def main(argv: list[str] | None = None) -> int:
    """``megaloop plan ...``; a :class:`~megaloop.errors.UserError` exits 2 with one line."""
    args = build_parser().parse_intermixed_args(argv)  # KEY=VALUE overrides may stand anywhere
    try:
        return _run(args)
    except UserError as err:
        return report(err, "megaloop plan")


def _run(args) -> int:
    from megaloop.plan.layout import make_layout
    from megaloop.plan.report import (format_plan, format_preflight, format_search, format_sweep, microbatch_sweep,
                                      plan_json, preflight_json, search_failure)
    from megaloop.plan.search import evaluate, memory_plan, search

    _check_flags(args)
    cfg, overrides, cluster, no_gpu, vocab, vocab_source = _inputs(args)
    if no_gpu and not args.preflight:
        raise ConfigError("--cluster: auto found no GPU on this machine")
    if no_gpu:  # still refuse what is wrong whatever the GPU (against the h100): --gpus/--nodes/--dp, the layout
        make_layout(cfg, _world(args, cfg, cluster))
        print("megaloop preflight: skipped (no GPU visible here; set PLAN_CLUSTER=h100|h200|b200|PATH to check)")
        return 0
    world = _world(args, cfg, cluster)
    steps = args.steps or DEFAULT_STEPS
    if args.search:
        held = _held(args, cfg, overrides)
        prod = held.get("tp", 1) * held.get("pp", 1) * held.get("dp", 1)
        if world % prod:
            raise ConfigError(f"--search: {world} GPUs are not divisible by the held "
                              f"{' x '.join(f'{k} {held[k]}' for k in ('tp', 'pp', 'dp') if k in held)} = {prod}")
        top = args.top or 10
        plans, excluded = search(args.config, overrides, cluster, world, vocab, steps, arm=args.arm, top=top,
                                 min_pp=args.min_pp or 1, fixed=held)
        if not plans:
            raise ConfigError(search_failure(excluded, cluster, world, held, args.min_pp or 1))
        for p in plans:
            p.vocab_source = vocab_source
        rep = {"plans": [plan_json(p) for p in plans], "excluded": excluded, "fitting": excluded["fitting"],
               "held": held, "steps": steps, "vocab": vocab, "vocab_source": vocab_source}
        _emit(args, rep, lambda: format_search(plans, excluded, cfg, cluster, world, held, steps, vocab, vocab_source))
        return 0
    layout = make_layout(cfg, world)
    if args.preflight:
        plan = memory_plan(cfg, layout, cluster, vocab)
        plan.vocab_source = vocab_source
        line = format_preflight(plan, args.config)
        if args.json or args.json_out:
            _emit(args, preflight_json(plan, args.config, line), lambda: line,
                  stream=sys.stdout if plan.fits or args.json else sys.stderr)
        else:
            print(line, file=sys.stdout if plan.fits else sys.stderr)
        return 0 if plan.fits else 2
    plan = evaluate(cfg, layout, cluster, vocab, steps)
    plan.vocab_source = vocab_source
    sweep = microbatch_sweep(cfg, layout, cluster, vocab, steps) if args.microbatch_sweep else None
    rep = plan_json(plan)
    if sweep is not None:
        rep["microbatch_sweep"] = sweep
    _emit(args, rep, lambda: format_plan(plan, args.config) + ("\n" + format_sweep(sweep) if sweep else ""))
    return 0


def _emit(args, rep: dict, text, stream=None) -> None:
    """Print the text report (or the JSON with --json); --json-out also writes the JSON (atomically:
    a temporary file beside it, then os.replace)."""
    if args.json_out:
        write_json(args.json_out, rep)
    print(json.dumps(rep, indent=1) if args.json else text(), file=stream or sys.stdout)


def write_json(path: str, rep: dict) -> None:
    """``rep`` as JSON at ``path``, atomically (:func:`megaloop.runtime.files.atomic_write_text`: a
    reader never sees half a report); ConfigError naming --json-out if the folder refuses it."""
    from megaloop.runtime.files import atomic_write_text

    try:
        atomic_write_text(path, json.dumps(rep, indent=1) + "\n")
    except OSError as err:
        raise ConfigError(f"--json-out: cannot write {path}: {err.strerror or err}") from None

if __name__ == "__main__":
    sys.exit(main())
