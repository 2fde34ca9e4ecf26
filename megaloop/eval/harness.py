"""lm-eval adapter: an ``lm_eval.api.model.LM`` over the :class:`InferenceEngine`.

Scoring follows the paper's protocol by default (``scoring="decode"``): a request's context is
prefilled at ``prefill_depth`` (parallel pass) into a KV cache (``cache_mode="terminal"``: the
terminal banks only; ``per_visit``: every visit), then the continuation is decoded one token at
a time at ``decode_depth`` through that cache, batched across requests and continuations
(:mod:`megaloop.eval.decode_score`). ``scoring="parallel"`` is the faster alternative: one
parallel pass over the continuation at ``depth`` reading the context through the cache
(``cache_mode="none"``: one plain parallel forward over context + continuation; parallel only).
``loglikelihood_rolling`` scores its windows the same way; ``generate_until`` decodes with the
engine (``prefill_depth``, then ``decode_depth`` per token).

Local tasks ship in ``megaloop/eval/tasks`` (``megaloop_toy_mc``: 24 questions; ``megaloop_synth``:
a group of ``megaloop_synth_k1..k8``, 50 held-out straight-line programs per chain length k, metrics
``acc`` = greedy exact match of the printed value and ``ce`` = its CE in nats, see
:mod:`megaloop.eval.synth`; JSONL beside the YAMLs, read by ``custom_dataset`` loaders that resolve
it against the YAML's folder, so plain ``lm_eval --include_path megaloop/eval/tasks`` works from any
directory). :func:`run_harness`
indexes that folder with ``TaskManager(include_path=...)``; plain YAMLs of ``--include-path``
folders get their relative ``dataset_kwargs.data_files`` made absolute (relative to the YAML).
Everything loads offline through the ``json`` builder. Importing this module registers the model
as ``megaloop`` for lm-eval's Python API: ``simple_evaluate(model="megaloop", model_args="checkpoint=DIR,depth=5",
tasks=task_specs(["megaloop_toy_mc"], [TASKS_DIR]), task_manager=...)``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from megaloop.config_utils import ConfigError
from megaloop.eval.decode_score import check_scoring
from megaloop.inference.kv_cache import check_depth

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
SHIPPED_TASKS = ("megaloop_toy_mc", "megaloop_synth")  # megaloop_synth: group of megaloop_synth_k1..k8
CACHE_MODES = ("terminal", "per_visit", "none")

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError:  # pragma: no cover - lm-eval is the optional [eval] extra
    LM = object  # type: ignore[misc,assignment]

    def register_model(*_names):  # type: ignore[no-redef]
        return lambda cls: cls


@register_model("megaloop")
class MegaloopLM(LM):
    """lm-eval model over an :class:`~megaloop.inference.engine.InferenceEngine`.

    Args:
        engine: the engine (or pass ``checkpoint=`` / ``hf=`` through ``create_from_arg_string``).
        depth: depth R of ``parallel`` continuation passes (default the engine's).
        prefill_depth: depth P of context prefill (default ``depth`` when given, else the
            engine's prefill depth).
        decode_depth: per-token depth D of ``decode`` scoring and ``generate_until`` (default
            ``depth`` when given, else the engine's decode depth).
        cache_mode: ``terminal`` (default), ``per_visit`` or ``none``.
        scoring: ``decode`` (default; token by token through the cache) or ``parallel``
            (default with ``cache_mode="none"``).
        batch_size: continuations scored per pass (rows decoded together).
        memory_check: before scoring (or generating) a set of requests, estimate the largest batch's
            memory (megaloop.eval.memory) and refuse, naming ``--batch-size``, one that does not fit.
        max_gen_toks: default generation length.
        policy: adaptive per-token exit of ``decode`` scoring and ``generate_until`` (an
            :class:`~megaloop.inference.adaptive.ExitPolicy`, whose ``max_depth`` caps the depth in
            place of ``decode_depth``); ``"engine"`` (default): the engine's ``exit`` (``--exit``);
            None: fixed depth ``decode_depth``. ``parallel`` scoring never uses it.
    """

    def __init__(self, engine=None, *, checkpoint: Optional[str] = None, hf: Optional[str] = None,
                 depth: Optional[int] = None, prefill_depth: Optional[int] = None,
                 decode_depth: Optional[int] = None, cache_mode: str = "terminal",
                 scoring: Optional[str] = None, batch_size: int = 16,
                 max_gen_toks: int = 64, device: str = "auto", dtype: str = "fp32", memory_check: bool = True,
                 max_batch_size: Optional[int] = None, policy: Any = "engine", **unknown):
        super().__init__()
        del max_batch_size  # lm-eval passes it with batch_size and device; batches here are fixed-size
        if unknown:  # a misspelled model_args key (e.g. `cache=`) would otherwise be dropped silently
            known = ("checkpoint", "hf", "depth", "prefill_depth", "decode_depth", "cache_mode", "scoring",
                     "batch_size", "max_gen_toks", "device", "dtype", "memory_check", "policy")
            raise ConfigError(f"megaloop lm-eval model: unknown model_args {', '.join(sorted(unknown))} "
                              f"(known: {', '.join(known)})")
        if engine is None:
            from megaloop.inference.engine import InferenceEngine

            if not (checkpoint or hf):
                raise ConfigError("megaloop lm-eval model: pass checkpoint=DIR or hf=DIR")
            engine = InferenceEngine.load(checkpoint or hf, device=device, dtype=dtype)
        if engine.tokenizer is None:
            raise ConfigError("lm-eval needs a tokenizer: the checkpoint's run has none (pass --tokenizer)")
        if cache_mode not in CACHE_MODES:
            raise ConfigError(f"--cache: one of {CACHE_MODES}, got {cache_mode!r}")
        self.engine = engine
        self.depth = check_depth(depth if depth is not None else engine.depth, "--depth")
        default = self.depth if depth is not None else None
        self.prefill_depth = check_depth(_first(prefill_depth, default, engine.prefill_depth), "--prefill-depth")
        self.decode_depth = check_depth(_first(decode_depth, default, engine.decode_depth), "--decode-depth")
        self.cache_mode = cache_mode
        self.scoring = check_scoring(scoring or ("parallel" if cache_mode == "none" else "decode"), cache_mode)
        self.batch_size = _batch_size(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.memory_check = memory_check not in (False, "false", "False", 0, "0")
        if isinstance(policy, str):  # "engine", or a criterion such as latent:1e-3 (model_args) capped at D
            from megaloop.inference.adaptive import exit_policy

            policy = engine.exit if policy == "engine" else exit_policy(policy, default_max_depth=self.decode_depth)
        self.policy = policy
        self._device = engine.device
        self.rope_extrapolated = False  # a request fed positions past the training seq_len
        self._cut_prompts = 0  # generate_until prompts cut on the left to leave max_gen_toks of room

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None):
        args = {}
        for part in filter(None, (arg_string or "").split(",")):
            key, _, value = part.partition("=")
            key = key.strip()  # text fields keep "none" (cache_mode=none is a mode, dtype=none is no dtype)
            args[key] = value.strip() if key in _TEXT_ARGS else _parse(value.strip())
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        if "device" in extra and "device" in args and str(args["device"]) != str(extra["device"]):
            raise ConfigError(f"megaloop lm-eval model: device={args['device']} in model_args and "
                              f"device={extra['device']} from lm-eval's --device; give one")
        args.update(extra)  # lm-eval's --device / simple_evaluate(device=...) was dropped (results named it)
        return cls(**args)

    # ------------------------------------------------------------ properties used by lm-eval
    @property
    def eot_token_id(self) -> int:
        return int(self.engine.eos_id if self.engine.eos_id is not None else 0)

    @property
    def max_length(self) -> int:
        return self.engine.max_context

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.engine.tokenizer, "path", "megaloop")).replace("/", "__")

    def tok_encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    # ------------------------------------------------------------ scoring
    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context / continuation ids as lm-eval's causal models take them: trailing context spaces move to
        the continuation, the context is encoded alone and the continuation is the joint encoding's tail past
        that many tokens, also where BPE merges across the boundary (scores then equal ``lm_eval --model hf``
        on the export; encoding the parts separately there differed from it). An empty tail (the joint
        encoding no longer than the context's), which lm-eval cannot score, takes the continuation's own."""
        n_space = len(context) - len(context.rstrip())
        if n_space:
            continuation = context[-n_space:] + continuation
            context = context[:-n_space]
        if not context:
            return [self.eot_token_id], self.tok_encode(continuation)
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        return ctx, whole[len(ctx):] or self.tok_encode(continuation)

    def _truncate(self, ctx: list[int], cont: list[int]) -> tuple[list[int], list[int]]:
        """Keep at most ``max_length`` input tokens (context + continuation[:-1]), cutting the
        context on the left (at least one context token is kept)."""
        limit = self.max_length
        if len(cont) > limit:  # scoring its tail after a 1-token context was silent (lm-eval's HF model asserts)
            raise ConfigError(f"loglikelihood: a continuation of {len(cont)} tokens does not fit the context window "
                              f"of {limit} tokens (max_length: the training seq_len, or --max-context)")
        room = limit + 1 - len(cont)  # inputs: ctx + cont[:-1]
        self._positions(len(ctx[-max(1, room):]) + len(cont) - 1)
        return ctx[-max(1, room):], cont

    def _positions(self, n: int) -> None:
        """Note that ``n`` positions are fed; past the training seq_len warn once (RoPE extrapolation,
        as every other eval verb does) and record it (``rope_extrapolated``)."""
        trained = int(self.engine.config.max_position_embeddings)
        if n > trained and not self.rope_extrapolated:
            print(f"warning: a request reaches {n} positions, beyond the training seq_len {trained}: RoPE positions "
                  f"{trained}..{n - 1} were never trained and are extrapolated", file=sys.stderr, flush=True)
        self.rope_extrapolated = self.rope_extrapolated or n > trained

    def _loglikelihood_tokens(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Scores of (context ids, continuation ids) pairs in this adapter's scoring mode."""
        from megaloop.eval.decode_score import decode_loglikelihood, parallel_loglikelihood

        self._check_memory(pairs)
        if self.scoring == "decode":
            return decode_loglikelihood(self.engine, pairs, prefill_depth=self.prefill_depth,
                                        decode_depth=self.decode_depth, cache_mode=self.cache_mode,
                                        batch_size=self.batch_size, policy=self.policy)
        return parallel_loglikelihood(self.engine, pairs, depth=self.depth, prefill_depth=self.prefill_depth,
                                      cache_mode=self.cache_mode, batch_size=self.batch_size)

    def _check_memory(self, pairs: list[tuple[list[int], list[int]]], max_new: int = 0) -> None:
        """Refuse (ConfigError naming ``--batch-size``) requests whose largest batch would not fit:
        the longest context and longest continuation (or ``max_new`` generated tokens) together, in
        a batch of ``batch_size`` rows (an upper bound: the longest need not share a batch)."""
        if not self.memory_check or not pairs:
            return
        from megaloop.eval.memory import check_decode_memory, describe, estimate_eval_memory, refuse_unless_fits

        eng, b = self.engine, min(self.batch_size, len(pairs)) if not max_new else 1
        ctx = max(len(c) for c, _ in pairs)
        cont = max(max(len(c) for _, c in pairs), max_new)
        # rows are left-padded to the longest context; one generation stops at the context length
        total = min(ctx + cont - 1, max(self.max_length, ctx)) if max_new else ctx + cont - 1
        fits = "--batch-size {n} fits"
        shrink = "use --cache terminal or lower the depths" if self.cache_mode != "terminal" else "lower the depths"
        what = f"--batch-size {b}, contexts of up to {ctx} tokens, continuations of up to {cont}"
        if max_new or self.scoring == "decode":
            mode = "per_visit" if self.cache_mode == "per_visit" else "terminal"
            depth = self.policy.max_depth if self.policy is not None else self.decode_depth
            check_decode_memory(eng, batch_size=b, prompt_len=ctx, total_len=total, prefill_depth=self.prefill_depth,
                                decode_depth=depth, mode=mode, what=what, fits=fits, shrink=shrink)
            return
        protocol = "native" if self.cache_mode == "none" else self.cache_mode
        est = estimate_eval_memory(eng.config, batch_size=b, seq_len=total, prefix_len=min(ctx, total - 1),
                                   depth=self.depth, prefill_depth=self.prefill_depth, protocols=(protocol,),
                                   dtype=eng.dtype)
        refuse_unless_fits(eng.device, est.total_bytes, b, fits,
                           f"{what}: one parallel pass at depth {self.depth} needs an estimated {describe(est)}",
                           shrink)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for req in requests:
            context, continuation = req.args[0], req.args[1]
            ctx, cont = self._encode_pair(context, continuation)
            if not cont:
                raise ConfigError(f"loglikelihood: empty continuation for context {context[-40:]!r}")
            pairs.append(self._truncate(ctx, cont))
        results = self._loglikelihood_tokens(pairs)
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Sum of log p over each text's disjoint rolling windows (EOS-conditioned first window);
        the windows of all requests are scored together in this adapter's scoring mode."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        pairs, owner = [], []
        for n, req in enumerate(requests):
            tokens = self.tok_encode(req.args[0])
            for ctx, cont in (make_disjoint_window(w) for w in get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.eot_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                pairs.append(self._truncate(list(ctx) or [self.eot_token_id], list(cont)))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (lp, _) in zip(owner, self._loglikelihood_tokens(pairs) if pairs else []):
            totals[n] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        if requests:  # one request at a time: the longest context with the longest generation
            longest = max(len(self.tok_encode(r.args[0]) or [0]) for r in requests)
            lengths = [int((r.args[1] or {}).get("max_gen_toks", self.max_gen_toks)) for r in requests]
            if min(lengths) < 1:  # it generated one token anyway
                raise ConfigError(f"generate_until: max_gen_toks must be >= 1, got {min(lengths)}")
            if max(lengths) >= self.max_length:  # the prompt was cut to one token, silently (lm-eval's HF asserts)
                raise ConfigError(f"generate_until: max_gen_toks {max(lengths)} leaves no room for the prompt in the "
                                  f"context window of {self.max_length} tokens (max_length: the training seq_len, "
                                  "or --max-context); lower max_gen_toks in the task's generation_kwargs or "
                                  "raise --max-context")
            self._check_memory([([0] * min(longest, self.max_length - max(lengths)), [0])], max_new=max(lengths))
        out = []
        for req in requests:
            context, kwargs = req.args[0], dict(req.args[1] or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            do_sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0)) if do_sample else 0.0
            ids = self.tok_encode(context) or [self.eot_token_id]
            if len(ids) > self.max_length - max_new:  # as lm-eval's HF model: room for max_gen_toks, said once
                if not self._cut_prompts:
                    print(f"warning: generate_until: a prompt of {len(ids)} tokens is cut on the left to "
                          f"{self.max_length - max_new} (max_length {self.max_length} - max_gen_toks {max_new})",
                          file=sys.stderr, flush=True)
                self._cut_prompts += 1
                ids = ids[-(self.max_length - max_new):]
            res = self.engine.generate(ids, max_new_tokens=max_new, temperature=temperature,
                                       top_p=float(kwargs.pop("top_p", 1.0) or 1.0),
                                       top_k=int(kwargs.pop("top_k", 0) or 0), seed=kwargs.pop("seed", 1234),
                                       stop=until, prefill_depth=self.prefill_depth,
                                       decode_depth=self.decode_depth,
                                       exit_criterion=self.policy if self.policy is not None else "none",
                                       cache_mode="per_visit" if self.cache_mode == "per_visit" else "terminal")
            text = res.results[0].text
            self._positions(len(ids) + max(len(res.results[0].token_ids) - 1, 0))  # the last token is not fed
            out.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out


# model_args read as text (a "none" here is a value, not Python's None)
_TEXT_ARGS = ("checkpoint", "hf", "cache_mode", "scoring", "device", "dtype", "policy")


def _batch_size(value: Any) -> int:
    """Rows per forward from model_args / lm-eval's --batch-size: an integer >= 1; lm-eval's ``auto`` (its
    own search for the largest batch) is the default 16 here, whose batches are fixed-size."""
    if isinstance(value, str) and value.strip().lower().startswith("auto"):
        return 16
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit())) \
            or int(value) < 1:
        raise ConfigError(f"--batch-size: must be an integer >= 1 (or lm-eval's auto), got {value!r}")
    return int(value)


def _first(*values):
    return next(v for v in values if v is not None)


def _parse(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(value.lower(), value)


# ----------------------------------------------------------------------------- tasks
class _FunctionTag(str):
    """A ``!function module.name`` value of an lm-eval YAML (kept as text)."""


def _read_task_yaml(path: Path, errors: Optional[list] = None):
    """A task YAML as a dict; lm-eval's ``!function`` tags become :class:`_FunctionTag`; None
    when unreadable (``errors`` gets ``"FILE: first line of the YAML error"``)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, tag, node: _FunctionTag(loader.construct_scalar(node)))
    try:
        return yaml.load(path.read_text(), Loader=Loader)  # noqa: S506 - SafeLoader subclass
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        if errors is not None:
            errors.append(f"{path}: {' '.join(str(err).split())[:200]}")
        return None


def _local_task_files(include_path: Sequence[Path], errors: Optional[list] = None) -> dict[str, Path]:
    out = {}
    for root in include_path:
        for f in sorted(Path(root).rglob("*.yaml")):
            cfg = _read_task_yaml(f, errors)
            if isinstance(cfg, dict) and isinstance(cfg.get("task"), str):
                out[cfg["task"]] = f
    return out


def _local_data_files(spec: dict) -> list[str]:
    """The local (not ``scheme://``) paths or glob patterns of an inline spec's ``data_files``."""
    files = (spec.get("dataset_kwargs") or {}).get("data_files")
    flat = [files] if isinstance(files, str) else list(files.values()) if isinstance(files, dict) else files or []
    out: list[str] = []
    for x in flat:
        out += [str(y) for y in (x if isinstance(x, list) else [x]) if "://" not in str(y)]
    return out


def check_task_inputs(specs: Sequence, include_path: Optional[Sequence[str | Path]], outputs: dict) -> None:
    """Before the model loads: every local data file of an inline task exists (a missing one was a
    ``FileNotFoundError`` traceback from ``datasets`` after the load), and no output path (``outputs``:
    flag → path) is a file the tasks are read from: a task YAML or ``!function`` module under a task
    folder, one of their data files, or anything in the shipped task folder (``--json`` overwrote them)."""
    import fnmatch
    import glob

    data, patterns = {}, []
    for spec in specs:
        if not isinstance(spec, dict):
            continue
        for pattern in _local_data_files(spec):
            found = glob.glob(pattern, recursive=True) if glob.has_magic(pattern) else \
                [pattern] if Path(pattern).is_file() else []
            if not found:
                raise ConfigError(f"--tasks {spec.get('task')}: its data file {pattern} does not exist "
                                  "(data_files of its YAML, relative to the YAML's folder)")
            data.update({Path(f).resolve(): spec.get("task") for f in found})
            patterns.append((str(Path(pattern).resolve()), spec.get("task")))  # a file the pattern would match later
    for flag, out in outputs.items():
        if not out:
            continue
        o = Path(out).expanduser().resolve()
        task = data.get(o) or next((t for pat, t in patterns if fnmatch.fnmatch(str(o), pat)), None)
        what = f"the data file of task {task}" if task else None
        for root in [TASKS_DIR, *(include_path or [])]:
            r = Path(root).resolve()
            if r in o.parents and (r == TASKS_DIR.resolve() or o.suffix in (".yaml", ".yml", ".py")):
                what = f"a file of the task folder {root}"
        if what:
            raise ConfigError(f"{flag} {out}: is {what}, which the tasks read; writing it would overwrite the "
                              "command's own input, choose another path")


def task_specs(tasks: Sequence[str], include_path: Sequence[Path]) -> list:
    """lm-eval task specs: tasks defined by plain YAMLs under ``include_path`` become inline
    dicts whose relative ``data_files`` are made absolute (relative to their YAML). Names of
    YAMLs with ``!function`` entries (e.g. the shipped tasks, whose ``custom_dataset`` loaders
    resolve their data beside the YAML themselves) and of other tasks pass through to lm-eval's
    own index and loader."""
    local = _local_task_files(include_path)
    specs: list = []
    for name in tasks:
        f = local.get(name)
        cfg = _read_task_yaml(f) if f is not None else None
        if cfg is None or any(isinstance(v, _FunctionTag) for v in cfg.values()):
            specs.append(name)
            continue
        files = (cfg.get("dataset_kwargs") or {}).get("data_files")
        if files is not None:
            def absolute(p):
                return p if "://" in str(p) or Path(p).is_absolute() else str((f.parent / p).resolve())

            if isinstance(files, dict):
                files = {k: ([absolute(x) for x in v] if isinstance(v, list) else absolute(v)) for k, v in files.items()}
            elif isinstance(files, list):
                files = [absolute(x) for x in files]
            else:
                files = absolute(files)
            cfg["dataset_kwargs"] = {**cfg["dataset_kwargs"], "data_files": files}
        specs.append(cfg)
    return specs


def resolve_tasks(tasks: Sequence[str], include_path: Optional[Sequence[str | Path]] = None,
                  include_defaults: bool = False):
    """``(TaskManager, specs)`` for ``tasks``; ConfigError naming unknown tasks (cheap: call it
    before loading a model). Only the shipped tasks (+ ``include_path``) are indexed unless
    ``include_defaults``."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    tasks = [t for t in tasks if t]
    if not tasks:
        raise ConfigError("--tasks: no task given")
    paths = [TASKS_DIR] + [Path(p) for p in (include_path or [])]
    for p in paths:
        if not p.is_dir():
            raise ConfigError(f"--include-path: {p} is not a directory")
    manager = TaskManager(include_path=[str(p) for p in paths], include_defaults=include_defaults)
    specs = task_specs(list(tasks), paths)
    unknown = [s for s in specs if isinstance(s, str) and s not in manager.all_tasks]
    if unknown:
        errors: list = []
        shipped = sorted(_local_task_files(paths, errors))
        raise ConfigError(f"--tasks: unknown task(s) {unknown}; local tasks: {shipped}"
                          + ("" if include_defaults else " (add --include-defaults for lm-eval's own tasks)")
                          + (f"; task files that are not valid YAML: {'; '.join(errors)}" if errors else ""))
    return manager, specs


def _is_dataset_load_error(err: BaseException) -> bool:
    """A network / offline / missing-dataset error of ``datasets`` or ``huggingface_hub`` (anywhere in
    the exception's chain)."""
    seen = 0
    while err is not None and seen < 10:
        name, mod = type(err).__name__, type(err).__module__ or ""
        if isinstance(err, ConnectionError) or "Offline" in name or "ConnectionError" in name or \
                name in ("DatasetNotFoundError", "DataFilesNotFoundError", "EmptyDatasetError") or \
                (mod.split(".")[0] in ("datasets", "huggingface_hub", "requests", "urllib3")
                 and isinstance(err, (OSError, ConnectionError))):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


@contextlib.contextmanager
def _quiet_git_hash():
    """lm-eval records ``git describe`` of the working directory and lets git print "fatal: not a git
    repository" on stderr outside a checkout; the same record, without git's message."""
    import lm_eval.evaluator as evaluator

    def git_hash():
        try:
            done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=30)
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
        try:  # lm-eval's own fallback: the commit of a .git folder above the working directory
            from lm_eval.loggers.utils import get_commit_from_path

            return get_commit_from_path(os.getcwd())
        except Exception:  # noqa: BLE001 - a record, never a reason to fail the evaluation
            return None

    original = getattr(evaluator, "get_git_commit_hash", None)
    if original is None:  # another lm-eval layout: leave it as it is
        yield
        return
    evaluator.get_git_commit_hash = git_hash
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original


def run_harness(lm: MegaloopLM, tasks: Sequence[str], *, limit: Optional[float] = None,
                num_fewshot: Optional[int] = None, include_path: Optional[Sequence[str | Path]] = None,
                include_defaults: bool = False, seed: int = 1234, resolved=None) -> dict:
    """Evaluate ``tasks`` with lm-eval; returns ``{"results": {task: {metric: value}}, "n_samples",
    "config"}`` (accuracies etc. per task; stderr is skipped: ``bootstrap_iters=0``)."""
    from lm_eval import simple_evaluate

    manager, specs = resolved or resolve_tasks(tasks, include_path, include_defaults)
    try:
        with _quiet_git_hash():
            out = simple_evaluate(model=lm, tasks=specs, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                                  bootstrap_iters=0, log_samples=False, random_seed=seed, numpy_random_seed=seed,
                                  torch_random_seed=seed, fewshot_random_seed=seed)
    except ValueError as err:
        if "larger than population" in str(err):
            raise ConfigError(f"--num-fewshot: {num_fewshot} examples exceed the few-shot examples the task "
                              f"({', '.join(tasks)}) has; lower --num-fewshot") from None
        raise
    except Exception as err:  # noqa: BLE001 - a dataset lm-eval could not download
        if type(err).__name__ == "UndefinedError":  # jinja2's: a template field the task's data lacks
            raise ConfigError(f"--tasks {','.join(tasks)}: a task's prompt template names a field its data does "
                              f"not have ({err})") from None
        if not _is_dataset_load_error(err):
            raise
        raise ConfigError(f"--tasks {','.join(tasks)}: the dataset of a task could not be loaded "
                          f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); offline? "
                          f"(HF_DATASETS_OFFLINE / HF_HUB_OFFLINE, or no network)") from None
    if out is None:  # lm-eval reports only where lm.rank == 0 and LOCAL_RANK == 0 (its TP-launcher rule)
        raise ConfigError(f"eval harness: lm-eval returned no results in this process (LOCAL_RANK="
                          f"{os.environ.get('LOCAL_RANK')}): it runs as one process; unset LOCAL_RANK (left by a "
                          "launcher) or run it without torchrun")
    results = {}
    for task, metrics in (out or {}).get("results", {}).items():  # lm-eval's "metric,filter": ",none" dropped
        results[task] = {k[:-len(",none")] if k.endswith(",none") else k: v for k, v in metrics.items()
                         if k not in ("alias", "name") and "stderr" not in k}
    from importlib.metadata import version

    return {"results": results, "n_samples": (out or {}).get("n-samples", {}),
            "versions": (out or {}).get("versions", {}), "n_shot": (out or {}).get("n-shot", {}),
            "lm_eval_version": version("lm_eval"),
            "config": {"seed": seed, "batch_size": lm.batch_size, "depth": lm.depth, "prefill_depth": lm.prefill_depth,
                       "decode_depth": lm.decode_depth,
                       "cache_mode": lm.cache_mode, "scoring": lm.scoring, "limit": limit, "num_fewshot": num_fewshot,
                       "exit": describe_policy(getattr(lm, "policy", None)),
                       "rope_extrapolated": getattr(lm, "rope_extrapolated", False),
                       "prompts_cut": getattr(lm, "_cut_prompts", 0)}}


def describe_policy(policy) -> Optional[dict]:
    """JSON of an adaptive-exit policy (``criterion``, ``min_depth``, ``max_depth`` = the cap,
    ``finished_rows``); None for fixed depth."""
    if policy is None:
        return None
    return {"criterion": policy.spec, "min_depth": policy.min_depth, "max_depth": policy.max_depth,
            "finished_rows": "compact" if policy.compaction else "mask"}


__all__ = ["MegaloopLM", "SHIPPED_TASKS", "TASKS_DIR", "describe_policy", "resolve_tasks", "run_harness", "task_specs"]
