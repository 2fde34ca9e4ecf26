"""Learning parity: train megaloop and a public reference implementation on the same batches.

One call trains one system and writes ``OUT/<label>.json``; ``--report OUT`` renders every result
in ``OUT`` as ``OUT/parity.md`` (tables) and ``OUT/parity.png`` (loss curves, PPL vs R).

    python tools/bench/parity.py --system megaloop --label megaloop_default --steps 800 --out DIR
    python tools/bench/parity.py --system megaloop --preset huginn_matched --steps 800 --out DIR
    python tools/bench/parity.py --system megaloop --label my_variant --steps 300 --out DIR model.input_norm=true
    python tools/bench/parity.py --system huginn --ref-path PATH/recurrent-pretraining --steps 800 --out DIR
    python tools/bench/parity.py --system parcae --ref-path PATH/parcae --steps 800 --out DIR
    python tools/bench/parity.py --report DIR
    python tools/bench/parity.py --add-copying DIR/run_LABEL DIR/LABEL.json
    python tools/bench/parity.py --check-training 20 --system huginn --preset huginn_matched --ref-path PATH --out DIR

The protocol (every system): megaloop's own train loader over the chosen data (default: the
embedded corpus) with the run's seed (``--init-seed`` re-draws only the initial weights), ``--batch`` sequences of the preset's ``seq_len`` per step in
the same order; AdamW (β 0.9/0.95, wd 0.1 on matrices, ε 1e-8), gradient clipping at 1, WSD (linear
warm-up over 10 % of the steps, constant, linear decay to 0 over the last 20 %, the same LR per
update as megaloop's scheduler, see ``parity_refs.wsd_lr``); mean depth ``--mean-depth`` with a
TBPTT window ``--bptt-window``, each system with its own depth sampler (megaloop: PLN per
microbatch unless the preset says otherwise; Huginn: poisson-lognormal-filling per step, its
``mean_recurrence`` set so that E[R] = ``--mean-depth`` (``--huginn-mean``); Parcae:
poisson-truncated-full per sequence). Validation: megaloop's whole validation split at every R in
``--depths`` (same tokens, labels and loss mask for every system; the evaluation-time state init of
each system). Diagnostics: :mod:`megaloop.eval.states` on the first ``--trace-seqs`` validation
sequences at R = ``--trace-depth``; the in-context copying probe (:mod:`parity_copying`) at R = 1, 5.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT  # noqa: E402

import torch  # noqa: E402
from parity_args import build_parser, check_args, masked_command, reference_mean_recurrence  # noqa: E402
from parity_copying import add_copying, copying_lines, megaloop_copying, probe_depths  # noqa: E402

# megaloop configurations the harness knows by name: preset + overrides. "default" is the tiny
# preset's model at the protocol's depth; the *_matched ones reproduce a reference's choices.
MEGALOOP_CONFIGS: dict[str, list[str]] = {
    "default": [],
    # Huginn's code (nebel-raven-3.5b at this shape): takase init (std √(2/5d), residual outputs
    # std/√(2·(1 + 2·5 + 1))), embeddings ×√d, tied, like-init state (std √(2/5d)·√d), rope 50k,
    # sandwich blocks (x <- norm(x + attn(norm(x))), x <- norm(x + mlp(norm(x)))): so e and the core
    # output already leave a learned-gain norm (no input_norm, no extra exit norm), per-head QK
    # biases before RoPE (qk_bias), the adapter initialised like the other matrices (std √(2/5d))
    # and without a bias (adapter_init=normal, adapter_bias=false), and its ln_f applied to the
    # final state before the coda as well as after it, one shared weight (state_final_norm).
    # (Earlier definitions: before sandwich_norm existed, input_norm=true and the parameter-free
    # exit norm stood in for the blocks' final norms (results/parity/steps*/huginn_matched.json);
    # huginn_matched_sw.json had neither QK biases nor the adapter's init, huginn_matched_qkb.json
    # no adapter init, huginn_matched_full.json no state_final_norm; each result's `overrides`
    # field records its definition.)
    "huginn_matched": ["model.injection=huginn_linear", "model.init_std=small", "model.embed_scale=sqrt_d",
                       "model.tie_embeddings=true", "model.state_init_std=0.6325", "model.sandwich_norm=true",
                       "model.input_norm=false", "model.exit_norm=false",
                       "model.out_init_std=0.01141", "model.rope_base=50000", "model.qk_norm=false",
                       "model.qk_bias=true", "model.adapter_init=normal", "model.adapter_bias=false",
                       "model.state_final_norm=true"],
    # Parcae's code (parcae-small-140m at this shape, SwiGLU, no value embeddings): pre-norm,
    # QK-norm, scaled-zero init (std √(2/5d), residual outputs 0), tied, prelude RMSNorm with
    # diagonal injection initialised at retention 1/√5 (= parcae_decay), like-init state (std
    # √(2/5d)), rope 50k, no embedding scale, orthogonal init (init_orthogonal), with q, k and v
    # orthogonal each (qkv_init_split: Parcae's separate c_q/c_k/c_v; its SwiGLU fc is one fused
    # [w1; w3] matrix, as megatron's fc1), the learned readout C before the coda (state_readout:
    # Parcae initialises C like its other weights, an orthogonal matrix at std √(2/5d), not the
    # identity; no weight decay), weightless QK-norm (qk_norm_gain=false: Parcae's F.rms_norm on q
    # and k has no gains) and Parcae's depth law max(Poisson(5), 1) (depth.kind=poisson; its trainer
    # draws it per sequence). (Earlier definitions: parcae_matched.json had neither orthogonal
    # init nor C, parcae_matched_ortho.json no C, parcae_matched_readout.json one orthogonal QKV
    # matrix, parcae_matched_qkvsplit.json learned QK-norm gains and PLN-5 depths, as their
    # `overrides` fields record.)
    "parcae_matched": ["model.injection=parcae_decay", "model.init_std=small", "model.embed_scale=1.0",
                       "model.tie_embeddings=true", "model.state_init_std=0.0559", "model.qk_norm=true",
                       "model.out_init_std=0", "model.rope_base=50000", "model.input_norm=false",
                       "model.init_orthogonal=true", "model.state_readout=true", "model.qkv_init_split=true",
                       "model.qk_norm_gain=false", "depth.kind=poisson"],
}


def _protocol_overrides(args) -> list[str]:
    warm = max(1, round(0.1 * args.steps))
    return [f"train.max_steps={args.steps}", f"optim.warmup_steps={warm}", "optim.decay_fraction=0.2",
            f"optim.lr={args.lr}", "optim.beta1=0.9", "optim.beta2=0.95", "optim.weight_decay=0.1",
            "optim.clip_grad=1.0", f"train.global_batch_size={args.batch}",
            f"train.micro_batch_size={args.micro_batch}", f"train.seed={args.seed}",
            "train.eval_batches=0", "train.log_interval=1000000", "train.eval_interval=0",
            f"train.save_interval={args.steps}", "depth.kind=pln", f"depth.mean={args.mean_depth}",
            "depth.cap=64", f"model.bptt_window={args.bptt_window}"]


def _trainer(args, overrides: list[str], run_dir: Path):
    from megaloop.config import load_config
    from megaloop.train.trainer import Trainer

    cfg = load_config(args.base, _protocol_overrides(args) + overrides)
    t = Trainer(cfg, run_dir)
    t.setup()
    return t


def _val_batches(trainer) -> list[dict]:
    from megaloop.data import build_eval_loader

    order = trainer._val_plan[0]  # the MixVal plan (a cached property of the trainer)
    loader = build_eval_loader(trainer.val_path, seq_len=trainer.val_seq, micro_batch_size=trainer.mbs,
                               dp_rank=0, dp_size=1, cache_dir=trainer.cfg.data.cache_dir, indices=order)
    out = [dict(b) for b in loader]
    loader.close()
    return out


def _trace_ids(val: list[dict], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([b["tokens"] for b in val])[:n]
    mask = torch.cat([b["loss_mask"] for b in val])[:n]
    return ids, mask


def run_megaloop(args, overrides: list[str], out_dir: Path) -> dict:
    from megaloop.eval.states import trace_diagnostics
    from megaloop.hf.load import load_model

    run_dir = out_dir / f"run_{args.label}"
    if (run_dir / "checkpoints").exists():
        sys.exit(f"{run_dir} holds an earlier run of label {args.label!r}: choose another --label "
                 "or remove that directory (nothing was changed)")
    t = _trainer(args, overrides, run_dir)
    losses, depths = [], []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        rec = t.train_step()
        losses.append(rec["loss"])
        depths.append(rec["mean_depth"])
    wall = time.perf_counter() - t0
    t.save()
    val = {str(r): t.evaluate(r)["val_ppl"] for r in args.depths}
    from megaloop.model.build import unwrap

    cores = [unwrap(m) for m in t.model]
    init = cores[0].cfg.eval_state_init
    for c in cores:  # control: the same depths from h^0 = 0 (no initial noise to wash out)
        c.cfg.eval_state_init = "zero"
    val_zero = {str(r): t.evaluate(r)["val_ppl"] for r in args.zero_init_depths}
    for c in cores:
        c.cfg.eval_state_init = init
    hf, _ = load_model(run_dir)
    ids, mask = _trace_ids(_val_batches(t), args.trace_seqs)
    diag = trace_diagnostics(hf, ids, args.trace_depth, mask=mask)
    copying = megaloop_copying(hf, t.cfg.model.seq_len, args.seed)
    prior = {"probs": [round(float(p), 8) for p in t.sampler.probs()], "mean_depth": t.sampler.mean_depth()}
    return {"losses": losses, "depths": depths, "val_ppl": val, "val_ppl_zero_init": val_zero, "states": diag,
            "copying": copying, "train_wall_s": wall, "config": t.cfg.to_dict()["model"], "overrides": overrides,
            "depth_prior_final": prior}  # the learned prior's (a fixed law's own) distribution after training


def run_reference(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="parity_loader_") as scratch:  # a refused run leaves nothing in OUT
        t = _trainer(args, [], Path(scratch) / "run")  # megaloop's loaders and validation plan only
        try:
            return _train_reference(args, t)
        finally:
            t.close()


def _train_reference(args, t) -> dict:
    from megaloop.eval.states import state_diagnostics
    from parity_refs import Shape, load_reference, make_optimizer, train_step, wsd_lr

    m = t.cfg.model
    mean_rec = reference_mean_recurrence(args)
    shape = Shape.of(m, t.vocab, mean_depth=mean_rec, bptt_window=args.bptt_window)
    ref = load_reference(args.system, args.ref_path, shape, args.init_seed)  # seeds its initial weights
    opt = make_optimizer(ref)
    # The committed reference curves ran before megaloop's loader read its first batch at set-up
    # (loaders.warm): torch's DataLoader iterator took its base seed from the global generator here,
    # after the reference drew its weights, and the reference's training-time h^0 draws follow that
    # stream. One int64 drawn here keeps them (without it every later draw shifted by one: Huginn's
    # step-1 loss 8.518011 where the committed runs have 8.512683).
    torch.empty((), dtype=torch.int64).random_()
    warm = max(1, round(0.1 * args.steps))
    losses, depths = [], []
    t0 = time.perf_counter()
    for step in range(args.steps):
        lr = wsd_lr(step + 1, args.lr, args.steps, warm, 0.2)
        loss, depth, _ = train_step(ref, opt, [next(t.loader_iter) for _ in range(t.M)], step, lr)
        losses.append(loss)
        depths.append(depth)
    wall = time.perf_counter() - t0
    val_batches = _val_batches(t)

    def ppl(r: int) -> float:
        s = n = 0.0
        for b in val_batches:
            logits = ref.logits(b["tokens"], r)
            ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), b["labels"].flatten(),
                                                   reduction="none").view_as(b["loss_mask"])
            s += float((ce * b["loss_mask"]).sum())
            n += float(b["loss_mask"].sum())
        return math.exp(s / n)

    torch.manual_seed(args.seed)  # the references draw their evaluation-time h^0 from torch's RNG
    val = {str(r): ppl(r) for r in args.depths}
    init = ref.cfg.state_init
    ref.cfg.state_init = "zero"  # control: h^0 = 0
    val_zero = {str(r): ppl(r) for r in args.zero_init_depths}
    ref.cfg.state_init = init
    ids, mask = _trace_ids(val_batches, args.trace_seqs)
    diag = state_diagnostics(mask=mask, **ref.trace(ids, args.trace_depth))
    copying = probe_depths(ref.logits, t.vocab, m.seq_len, args.seed)
    return {"losses": losses, "depths": depths, "val_ppl": val, "val_ppl_zero_init": val_zero, "states": diag,
            "copying": copying, "train_wall_s": wall, "reference_commit": ref.commit, "reference_path_name": Path(args.ref_path).name,
            "reference_mean_recurrence": mean_rec,
            "huginn_mean": args.huginn_mean if args.system == "huginn" else None}


def check_forward(args, out_dir: Path) -> tuple[dict, bool]:
    """Weights of the megaloop model at ``args.check_forward`` copied into the reference; logits of
    both at ``--depths`` from h⁰ = 0 on the first ``--trace-seqs`` validation sequences
    (:mod:`parity_transfer`). Returns (result, agree within ``--forward-tol``)."""
    from megaloop.hf.load import load_model
    from parity_refs import Shape, load_reference
    from parity_transfer import compare, require_transferable, transfer

    hf, _ = load_model(args.check_forward)
    hf = hf.float()
    c = hf.config
    require_transferable(c, args.system)  # before building the reference or reading data
    with tempfile.TemporaryDirectory() as scratch:  # megaloop's validation sequences only
        t = _trainer(args, [], Path(scratch) / "run")
        if t.vocab != c.vocab_size:
            raise SystemExit(f"--check-forward: the model's vocab_size {c.vocab_size} differs from the --base "
                             f"{args.base} preset's {t.vocab} (pass the preset the model was trained with)")
        ids, _ = _trace_ids(_val_batches(t), args.trace_seqs)
    shape = Shape(hidden=c.hidden_size, heads=c.num_attention_heads, ffn=c.intermediate_size, n_prelude=c.n_prelude,
                  n_core=c.n_core, n_coda=c.n_coda, vocab=c.vocab_size, seq_len=ids.shape[1],
                  mean_depth=int(args.mean_depth), bptt_window=args.bptt_window)
    ref = load_reference(args.system, args.ref_path, shape, args.init_seed)
    transfer(hf, ref)
    res = compare(hf, ref, ids, list(args.depths))
    res.update(reference_commit=ref.commit, model=Path(args.check_forward).name, tolerance=args.forward_tol,
               agree_own_forward=all(r["max_abs_diff"] <= args.forward_tol for r in res["rows"]))
    if args.system == "huginn":
        res["agree_without_state_norm"] = all(r["no_state_norm_max_abs_diff"] <= args.forward_tol
                                              for r in res["rows"])
    return res, res["agree_own_forward"]


def _forward_lines(res: dict, system: str) -> list[str]:
    huginn = system == "huginn"
    head = "| R | logits RMS | max abs diff | RMS diff |" + (" max abs diff, no pre-coda ln_f |" if huginn else "")
    lines = [head, "|" + "---|" * (5 if huginn else 4)]
    for r in res["rows"]:
        lines.append(f"| {r['R']} | {r['logits_rms']:.3f} | {r['max_abs_diff']:.2e} | {r['rms_diff']:.2e} |" +
                     (f" {r['no_state_norm_max_abs_diff']:.2e} |" if huginn else ""))
    ctl = res["control"]
    lines.append(f"control ({ctl['perturbed']}, R={ctl['R']}): max abs diff {ctl['max_abs_diff']:.2e}")
    lines.append(f"agree with the reference's own forward within {res['tolerance']:g}: {res['agree_own_forward']}")
    if huginn:
        lines.append(f"agree with Huginn's forward minus its ln_f on the final state (before the coda): "
                     f"{res['agree_without_state_norm']}")
    return lines


# ------------------------------------------------------------------ report
def _mean_last(xs: list[float], k: int = 10) -> float:
    return sum(xs[-k:]) / len(xs[-k:])


def _gain(v: dict) -> float:
    return 100 * (1 - v["5"] / v["1"]) if "1" in v and "5" in v else float("nan")


# Model options added later whose value that keeps the earlier behaviour is not off/None: results
# made before the option existed lack the key and group with results that hold this value.
LEGACY_VALUES = {"qk_norm_gain": True}


def _init_draw_groups(res: list[dict]) -> list[list[dict]]:
    """Groups of >= 2 results that differ only in their initial weights (``--init-seed``): same
    system, steps, batch seed, and for megaloop the same model config and depth draws (so the same
    depth law); a reference: same commit and ``mean_recurrence`` setting (results made before it was
    recorded all used 5, the default ``--mean-depth`` under ``--huginn-mean native``)."""
    def off_dropped(cfg):  # an option a later release added reads as absent at its old behaviour
        return ({k: off_dropped(v) for k, v in cfg.items()
                 if (v != LEGACY_VALUES[k] if k in LEGACY_VALUES else v is not None and v is not False)}
                if isinstance(cfg, dict) else cfg)

    groups: dict[str, list[dict]] = {}
    for r in res:
        what = ([off_dropped(r.get("config")), r.get("depths")] if r["system"] == "megaloop"
                else [r.get("reference_commit"), r.get("reference_mean_recurrence", 5)])
        groups.setdefault(json.dumps([r["system"], r["steps"], r.get("seed"), what], sort_keys=True), []).append(r)
    out = []
    for g in (g for g in groups.values() if len(g) >= 2):
        if len({r.get("init_seed", r.get("seed")) for r in g}) == len(g):
            out.append(g)
        else:  # reruns of one init draw are not a spread; say so rather than drop the group silently
            print(f"parity report: no init-draw spread for {', '.join(r['label'] for r in g)}: "
                  "the same config at a repeated init seed", file=sys.stderr)
    return out


def welch(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Welch's unequal-variance t test of mean(xs) vs mean(ys): (t, Welch–Satterthwaite df,
    two-sided p). Needs >= 2 values on each side."""
    try:
        from scipy import stats
    except ImportError:  # an ImportError traceback, exit 1 and no report
        raise SystemExit("--report: the Welch tests of the init-draw groups need scipy "
                         "(pip install -e '.[eval]', or pip install scipy)") from None
    r = stats.ttest_ind(xs, ys, equal_var=False)
    return float(r.statistic), float(r.df), float(r.pvalue)


# Issue #19's acceptance bars for a reference-matched config vs its reference.
LOSS_BAR, GAIN_RATIO_BAR = 0.03, 1.5


def _test(t: float, df: float, p: float) -> str:
    return f"t = {t:.2f}, df = {df:.1f}, p " + (f"= {p:.3f}" if p >= 1e-3 else "< 0.001")


def _vs_reference_table(groups: list[list[dict]]) -> list[str]:
    """Every megaloop init-draw group against every reference group of the same steps and batch
    seed, on the means over draws: Δ train loss (megaloop − reference), the ratio of R=1→5 gains
    (larger / smaller), each with Welch's t test over the draws, and whether the bars hold."""
    from megaloop.repro.verdicts import mean_sd

    rows = []
    for m in (g for g in groups if g[0]["system"] == "megaloop"):
        for ref in (g for g in groups if g[0]["system"] != "megaloop"):
            if (m[0]["steps"], m[0].get("seed")) != (ref[0]["steps"], ref[0].get("seed")):
                continue
            ml, rl = [_mean_last(r["losses"]) for r in m], [_mean_last(r["losses"]) for r in ref]
            mg, rg = [_gain(r["val_ppl"]) for r in m], [_gain(r["val_ppl"]) for r in ref]
            dl = mean_sd(ml)[0] - mean_sd(rl)[0]
            gm, gr = mean_sd(mg)[0], mean_sd(rg)[0]
            ratio = max(gm, gr) / min(gm, gr) if min(gm, gr) > 0 else float("inf")
            tl, dfl, pl = welch(ml, rl)
            tg, dfg, pg = welch(mg, rg)
            depth = mean_sd([sum(r["depths"]) / len(r["depths"]) for r in ref])[0]  # what tells groups apart
            rows.append(f"| {m[0]['label']} ({len(m)}) | {ref[0]['label']}, {ref[0]['system']} at mean depth "
                        f"{depth:.2f} ({len(ref)}) | {dl:+.3f} | "
                        f"{_test(tl, dfl, pl)} | {'yes' if abs(dl) <= LOSS_BAR else 'no'} | "
                        f"{gm:.2f} % vs {gr:.2f} % | {ratio:.2f} | {_test(tg, dfg, pg)} | "
                        f"{'yes' if ratio <= GAIN_RATIO_BAR else 'no'} |")
    if not rows:
        return []
    return ["", f"Against each reference, on the means over init draws; bars of a reference-matched config "
            f"(|Δ loss| ≤ {LOSS_BAR} nats, gain ratio ≤ {GAIN_RATIO_BAR}); Welch's t test over the draws "
            "(two-sided).", "",
            "| megaloop (draws) | reference (draws) | Δ train loss | loss test | loss bar | gain R=1→5 | "
            "gain ratio | gain test | gain bar |", "|---|---|---|---|---|---|---|---|---|", *rows]


def _spread_table(res: list[dict]) -> list[str]:
    """Mean ± sample sd over every init-draw group (:func:`_init_draw_groups`), then the
    megaloop-vs-reference comparison of the groups."""
    from megaloop.repro.verdicts import mean_sd

    groups = _init_draw_groups(res)
    rows = []
    for g in groups:
        inits = {r.get("init_seed", r.get("seed")) for r in g}

        def cell(xs: list[float], fmt: str) -> str:
            mean, sd = mean_sd(xs)
            return f"{mean:{fmt}} ± {sd:{fmt}}"

        nan = float("nan")  # a run of other --depths
        gains = [_gain(r["val_ppl"]) for r in g]
        rows.append(f"| {', '.join(r['label'] for r in g)} | {g[0]['system']} | {sorted(inits)} | "
                    f"{cell([_mean_last(r['losses']) for r in g], '.3f')} | "
                    f"{cell([r['val_ppl'].get('1', nan) for r in g], '.2f')} | "
                    f"{cell([r['val_ppl'].get('5', nan) for r in g], '.2f')} | "
                    f"{cell(gains, '.2f')} % ({min(gains):.2f}–{max(gains):.2f}) |")
    if not rows:
        return []
    return ["", "Init-draw spread: runs that differ only in their initial weights (`--init-seed`; same batches "
            "and depth draws), mean ± sample sd (gain: min–max).", "",
            "| runs | system | init seeds | train loss | val PPL R=1 | val PPL R=5 | gain R=1→5 |",
            "|---|---|---|---|---|---|---|", *rows, *_vs_reference_table(groups), *_window_table(groups)]


def _window_table(groups: list[list[dict]], windows: int = 8) -> list[str]:
    """Training loss of each init-draw group averaged over ``windows`` equal step windows (and over
    the group's draws), groups of the same steps and batch seed side by side: where one curve
    overtakes another. Every group reads the same batches, so batch noise cancels in the columns."""
    out = []
    by_run: dict = {}
    for g in groups:
        by_run.setdefault((g[0]["steps"], g[0].get("seed")), []).append(g)
    for (steps, _), gs in sorted(by_run.items(), key=lambda kv: kv[0][0]):
        if len(gs) < 2 or steps < windows:
            continue
        w = steps // windows
        edges = [(a, a + w) for a in range(0, w * windows, w)]  # a remainder of < windows steps is left out
        names = [f"{g[0]['label']} ({len(g)})" for g in gs]
        rows = []
        for a, b in edges:
            means = [sum(sum(r["losses"][a:b]) / (b - a) for r in g) / len(g) for g in gs]
            rows.append(f"| {a + 1}–{b} | " + " | ".join(f"{m:.3f}" for m in means) + " |")
        out += ["", f"Training loss per {w}-step window, mean over each group's init draws ({steps} steps; "
                "groups named by their first run, draws in brackets).", "",
                "| steps | " + " | ".join(names) + " |", "|---" * (len(gs) + 1) + "|", *rows]
    return out


def render(out_dir: Path) -> Path:
    """parity.md + parity.png from every ``*.json`` result in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = []
    for path in sorted(out_dir.glob("*.json")):
        try:
            res.append(json.loads(path.read_text()))
        except ValueError as err:
            raise SystemExit(f"--report {out_dir}: {path.name} is not valid JSON ({err})") from None
    res = [r for r in res if "losses" in r]  # not --check-forward/--check-training results
    if not res:
        raise SystemExit(f"--report {out_dir}: no training results there (*.json written by a training run)")
    # one column per depth any run evaluated, in order; a run that did not evaluate it shows "–" (the
    # header was the first run's --depths, so runs of other --depths were put under wrong columns)
    cols = sorted({d for r in res for d in r["depths_evaluated"]})
    lines = ["| run | system | steps | train loss (mean last 10) | " +
             " | ".join(f"val PPL R={r}" for r in cols) + " | gain R=1→5 | gain, h^0=0 | mean depth |",
             "|---" * (7 + len(cols)) + "|"]
    for r in res:
        v = r["val_ppl"]
        gain, gz = _gain(v), _gain(r.get("val_ppl_zero_init", {}))
        lines.append(f"| {r['label']} | {r['system']} | {r['steps']} | {_mean_last(r['losses']):.3f} | " +
                     " | ".join(f"{v[str(d)]:.2f}" if str(d) in v else "–" for d in cols) +
                     f" | {gain:.2f} % | {gz:.2f} % | {sum(r['depths']) / len(r['depths']):.2f} |")
    lines += ["", "Recurrence diagnostics (validation sequences, R = trace depth): relative state change "
              "‖h^r−h^{r−1}‖/‖h^r‖ at r = 2/3/4, state share of the injection at r = 2, RMS of e and h^R, "
              "contraction at r = 3.", "",
              "| run | rel change r=2 | r=3 | r=4 | state share r=2 | RMS e | RMS h^R | contraction r=3 |",
              "|---|---|---|---|---|---|---|---|"]
    for r in res:
        rows = r["states"]["per_recurrence"]
        lines.append(f"| {r['label']} | {rows[1]['rel_change']:.3g} | {rows[2]['rel_change']:.3g} | "
                     f"{rows[3]['rel_change']:.3g} | {rows[1]['state_share']:.3f} | {r['states']['rms_e']:.3g} | "
                     f"{rows[-1]['rms_h']:.3g} | {rows[2]['contraction']:.3g} |")
    lines += _spread_table(res) + copying_lines(res)
    lines += ["", "Commands:", ""] + [f"- `{r['command']}`" + (f" (run as `{r['command_as_run']}` before "
                                                             "an option changed; the same settings)"
                                                             if r.get("command_as_run") else "") for r in res]
    refs = {r["system"]: r.get("reference_commit") for r in res if r.get("reference_commit")}
    if refs:
        lines += ["", "References: " + ", ".join(f"{k} at commit {v}" for k, v in sorted(refs.items()))]
    md = out_dir / "parity.md"
    md.write_text("\n".join(lines) + "\n")

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in res:
        xs = r["losses"]
        k = max(1, len(xs) // 40)
        sm = [sum(xs[max(0, i - k):i + 1]) / len(xs[max(0, i - k):i + 1]) for i in range(len(xs))]
        a.plot(range(1, len(xs) + 1), sm, label=r["label"])
        ds = r["depths_evaluated"]
        b.plot(ds, [r["val_ppl"][str(d)] for d in ds], marker="o", label=r["label"])
    a.set_xlabel("step")
    a.set_ylabel("train loss (smoothed)")
    a.legend(fontsize=7)
    b.set_xscale("log", base=2)
    b.set_xlabel("recurrences R")
    b.set_ylabel("validation PPL")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "parity.png", dpi=110)
    return md


def _write_result(out: Path, label: str, res: dict) -> None:
    """``OUT/<label>.json``, written atomically (a result is never left half-written)."""
    from megaloop.runtime.files import atomic_write_json

    atomic_write_json(out / f"{label}.json", res, indent=1, sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    p = build_parser(__doc__, sorted(MEGALOOP_CONFIGS), str(ROOT / "tools" / "bench" / "results" / "parity"))
    args = p.parse_args(argv)
    if args.add_copying:
        print(json.dumps(add_copying(Path(args.add_copying[0]), Path(args.add_copying[1])), indent=1))
        return 0
    if args.report:
        print(render(Path(args.report)).read_text())
        return 0
    if not args.system:
        p.error("--system is required (or --report DIR)")
    if args.system != "megaloop" and not args.ref_path:
        p.error(f"--ref-path: the {args.system} reference needs the path of its checkout")
    if args.check_training is not None:
        if args.check_forward:
            p.error("--check-training: not together with --check-forward (run them one at a time)")
        if args.system != "huginn":
            p.error("--check-training: --system must be huginn (Parcae draws a depth per sequence)")
        if not 1 <= args.check_training <= args.steps:
            p.error(f"--check-training: must lie in [1, --steps={args.steps}], got {args.check_training}")
        if args.check_depth < 1:
            p.error(f"--check-depth: must be >= 1, got {args.check_depth}")
    if args.system != "megaloop":
        from parity_refs import reference_root

        reference_root(args.system, args.ref_path)  # before any training or loading
        reference_mean_recurrence(args)
    if args.check_forward and args.system == "megaloop":
        p.error("--check-forward: --system must name the reference (huginn or parcae)")
    if args.check_forward and not Path(args.check_forward).exists():
        p.error(f"--check-forward: {args.check_forward} does not exist")
    if args.preset not in MEGALOOP_CONFIGS:
        p.error(f"--preset: unknown {args.preset!r}; one of {sorted(MEGALOOP_CONFIGS)}")
    check_args(p, args, MEGALOOP_CONFIGS, _protocol_overrides)
    torch.set_num_threads(args.threads)
    init_given = args.init_seed is not None
    args.init_seed = args.init_seed if init_given else args.seed
    args.label = args.label or (args.system if args.system != "megaloop" else f"megaloop_{args.preset}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    argv = list(argv if argv is not None else sys.argv[1:])
    if args.check_forward:
        args.label = args.label if args.label != args.system else f"forward_{args.system}"
        res, agree = check_forward(args, out)
        res.update(label=args.label, system=args.system, check="forward", seed=args.seed,
                   command=masked_command(argv, REF_PATH=args.ref_path, MODEL=args.check_forward))
        _write_result(out, args.label, res)
        print("\n".join(_forward_lines(res, args.system)))
        return 0 if agree else 1
    if args.check_training:
        from parity_train_check import check_training, summary_lines

        args.label = args.label if args.label != args.system else "train_check_huginn"
        init = [f"train.init_seed={args.init_seed}"] if init_given else []
        with tempfile.TemporaryDirectory() as scratch:
            res = check_training(args, _trainer, MEGALOOP_CONFIGS[args.preset] + init + list(args.overrides),
                                 Path(scratch))
        res.update(label=args.label, system=args.system, check="training", preset=args.preset, seed=args.seed,
                   command=masked_command(argv, REF_PATH=args.ref_path))
        _write_result(out, args.label, res)
        print("\n".join(summary_lines(res)))
        return 0 if res["agree"] else 1
    if (out / f"{args.label}.json").exists():  # a reference run replaced it without a word
        raise SystemExit(f"{out / (args.label + '.json')} holds an earlier result of label {args.label!r}: choose "
                         "another --label or remove that file (nothing was changed)")
    if args.system == "megaloop":
        init = [f"train.init_seed={args.init_seed}"] if init_given else []
        res = run_megaloop(args, MEGALOOP_CONFIGS[args.preset] + init + list(args.overrides), out)
    else:
        res = run_reference(args)
    res.update(label=args.label, system=args.system, steps=args.steps, depths_evaluated=args.depths,
               seed=args.seed, init_seed=args.init_seed,
               command=masked_command(argv, REF_PATH=args.ref_path))
    _write_result(out, args.label, res)
    v = res["val_ppl"]
    print(f"{args.label}: train loss (last 10) {_mean_last(res['losses']):.4f}  val PPL " +
          " ".join(f"R={k}:{x:.2f}" for k, x in v.items()) + f"  ({res['train_wall_s']:.0f} s)")
    return 0


def _cli() -> int:
    """``main`` as a command: a refusal raised as ``SystemExit(message)`` anywhere in the harness (a
    reference checkout, a result file, an option checked late) is one line and exit 2, as argparse's."""
    try:
        return main()
    except SystemExit as stop:
        if isinstance(stop.code, str):
            print(f"parity.py: error: {stop.code}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(_cli())
