"""``megaloop plan``: memory per rank, step time, bubble and MFU of a layout before the cluster runs it.

    megaloop plan --config L --cluster h100 --gpus 64 --tp 2 --pp 4 [KEY=VALUE ...]
    megaloop plan --config M --gpus 64 --search            # ranked layouts that fit
    megaloop plan --config S --gpus 16 --preflight ...     # one line; exit 2 if predicted not to fit

The layout comes from the config (``parallel.*``, ``train.micro_batch_size``, ``model.recompute``,
``model.fp8``) and the flags below, which are shorthands for those overrides; ``cluster.KEY=VALUE``
overrides edit the cluster description. All numbers are predictions: the GPU constants of the cost
model (efficiencies, latencies, reserve, fragmentation) are assumptions until a GPU run calibrates
them (tools/gpu_check.sh records what they need). Exit 2 with one line naming the field on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from megaloop.config_utils import ConfigError
from megaloop.errors import UserError, report

DEFAULT_VOCAB = 65536  # the README's presets table; model.vocab_size=0 means "from the tokenizer"


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
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--pp", type=int, default=None)
    p.add_argument("--vpp", type=int, default=None, help="model chunks per pipeline rank (interleaved 1F1B)")
    p.add_argument("--mbs", type=int, default=None, help="micro-batch size")
    p.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--dist-opt", action=argparse.BooleanOptionalAction, default=None,
                   help="distributed optimizer (optimizer state sharded over DP)")
    p.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None, help="sequence parallelism")
    p.add_argument("--fp8", default=None, help="hybrid | e4m3 | none")
    p.add_argument("--vocab", type=int, default=None,
                   help=f"vocabulary size when model.vocab_size is 0 (default {DEFAULT_VOCAB})")
    p.add_argument("--steps", type=int, default=None, help="sampled optimizer steps (default 32; 8 with --search)")
    p.add_argument("--search", action="store_true",
                   help="rank the layouts (TP, PP, VPP, micro-batch, recompute, SP) that fit on --gpus")
    p.add_argument("--top", type=int, default=10, help="layouts listed by --search")
    p.add_argument("--min-pp", type=int, default=1, help="--search: only layouts with at least this pipeline size")
    p.add_argument("--microbatch-sweep", action="store_true",
                   help="bubble with sampled vs fixed depth as the microbatch count grows (same layout)")
    p.add_argument("--preflight", action="store_true",
                   help="memory check only; one line; exit 2 if predicted not to fit")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--json-out", default=None, help="also write the JSON report to this file")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides; cluster.KEY=VALUE edits the cluster")
    return p


def _cluster(args, cluster_ov: list[str]):
    """The cluster description; ``auto`` = this machine's GPU (None when there is none)."""
    from megaloop.plan.cluster import load_cluster, shipped_clusters

    name = args.cluster
    if name.lower() == "auto":
        import torch

        if not torch.cuda.is_available():
            return None
        gpu = torch.cuda.get_device_name(0)
        mem = torch.cuda.get_device_properties(0).total_memory / 2**30
        base = next((c for c in shipped_clusters() if c.upper() in gpu.upper()), "h100")
        return load_cluster(base, [f"gpu={gpu.replace(' ', '_')}", f"gpu_memory_gib={mem:.1f}", *cluster_ov])
    return load_cluster(name, cluster_ov)


def _inputs(args):
    from megaloop.config import load_config
    from megaloop.plan.layout import layout_overrides

    cluster_ov = [o for o in args.overrides if o.startswith("cluster.")]
    overrides = [o for o in args.overrides if not o.startswith("cluster.")]
    overrides += layout_overrides(args.tp, args.pp, args.vpp, args.mbs, args.recompute, args.dist_opt,
                                  args.fp8, args.sp)
    cluster = _cluster(args, cluster_ov)
    cfg = load_config(args.config, overrides, arm=args.arm)
    cfg.check_trainable()
    if args.vocab is not None and args.vocab < 1:
        raise ConfigError(f"--vocab: must be >= 1, got {args.vocab}")
    vocab = cfg.model.vocab_size or args.vocab or DEFAULT_VOCAB
    for flag in ("gpus", "nodes", "dp"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ConfigError(f"--{flag}: must be >= 1, got {v}")
    return cfg, overrides, cluster, vocab


def _world(args, cfg, cluster) -> int:
    if args.dp is not None:
        world = cfg.parallel.tp * cfg.parallel.pp * args.dp
        if args.gpus is not None and args.gpus != world:
            raise ConfigError(f"--dp: tp x pp x dp = {world} but --gpus {args.gpus}")
        return world
    if args.gpus is not None:
        return args.gpus
    return (args.nodes or cluster.nodes) * cluster.gpus_per_node


def main(argv: list[str] | None = None) -> int:
    """``megaloop plan ...``; a :class:`~megaloop.errors.UserError` exits 2 with one line."""
    args = build_parser().parse_intermixed_args(argv)  # KEY=VALUE overrides may stand anywhere
    try:
        return _run(args)
    except UserError as err:
        return report(err, "megaloop plan")


def _run(args) -> int:
    from megaloop.plan.layout import make_layout
    from megaloop.plan.report import (format_plan, format_preflight, format_search, format_sweep, plan_json,
                                      microbatch_sweep)
    from megaloop.plan.search import evaluate, memory_plan, search

    cfg, overrides, cluster, vocab = _inputs(args)
    if cluster is None and not args.preflight:
        raise ConfigError("--cluster: auto found no GPU on this machine")
    if cluster is None:
        print("megaloop preflight: skipped (no GPU visible here; set PLAN_CLUSTER=h100|h200|b200|PATH to check)")
        return 0
    world = _world(args, cfg, cluster)
    if args.search:
        plans, excluded = search(args.config, overrides, cluster, world, vocab, args.steps or 8, arm=args.arm,
                                 top=args.top, min_pp=args.min_pp)
        rep = {"plans": [plan_json(p) for p in plans[:args.top]], "excluded": excluded, "fitting": len(plans)}
        _emit(args, rep, lambda: format_search(plans[:args.top], excluded, cfg, cluster, world, len(plans)))
        return 0
    layout = make_layout(cfg, world)
    if args.preflight:
        plan = memory_plan(cfg, layout, cluster, vocab)
        line = format_preflight(plan, args.config)
        print(line, file=sys.stdout if plan.fits else sys.stderr)
        return 0 if plan.fits else 2
    plan = evaluate(cfg, layout, cluster, vocab, args.steps or 32)
    sweep = microbatch_sweep(cfg, layout, cluster, vocab, args.steps or 32) if args.microbatch_sweep else None
    rep = plan_json(plan)
    if sweep is not None:
        rep["microbatch_sweep"] = sweep
    _emit(args, rep, lambda: format_plan(plan, args.config) + ("\n" + format_sweep(sweep) if sweep else ""))
    return 0


def _emit(args, rep: dict, text) -> None:
    """Print the text report (or the JSON with --json); --json-out also writes the JSON."""
    if args.json_out:
        from pathlib import Path

        Path(args.json_out).write_text(json.dumps(rep, indent=1))
    print(json.dumps(rep, indent=1) if args.json else text())


if __name__ == "__main__":
    sys.exit(main())
