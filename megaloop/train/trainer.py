"""The training loop: depth plan → megatron forward/backward → optimizer → depth-prior update.

One optimizer step (SPEC §4–§6, DESIGN "data path"):
1. the sampler draws the step's M depths from (seed, step) — identical on every rank;
2. this data-parallel rank takes M microbatches from the loader;
3. megatron's ``get_forward_backward_func`` runs them (no pipelining, 1F1B or interleaved);
   each microbatch runs at its own depth with a TBPTT window of ``b = min(r, bptt_window)``;
4. the loss function returns the CE *sum* and token count (``calculate_per_token_loss``), so the
   model gradient is the global token-weighted mean; per-microbatch sums and counts are kept;
5. those sums/counts are all-reduced over data-parallel ranks (and shared over the pipeline),
   giving the detached global ℓ_i, N_i of each microbatch;
6. optimizer step, then the prior update from (r_i, ℓ_i, N_i), then metrics and FLOPs.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from functools import cached_property, partial
from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer_config import ParamKey
from megatron.core.pipeline_parallel import get_forward_backward_func

from megaloop.config import RunConfig
from megaloop.config_utils import ConfigError
from megaloop.depth.sampler import DepthSampler, assert_plan_synchronised
from megaloop.model.build import build_model, unwrap
from megaloop.model.config import size_line
from megaloop.runtime.agree import on_every_rank, on_every_rank_each_step
from megaloop.runtime.exits import EXIT_OK, shield_resource_tracker
from megaloop.runtime.parallel import (ParallelDims, compute_device, init_distributed, stable_seed,
                                       world_size_from_env)
from megaloop.runtime.stop import SignalStop, exit_code
from megaloop.train.checkpoint import CheckpointManager, CheckpointSaveError
from megaloop.train.flops import device_peak_tflops, microbatch_flops
from megaloop.train.grads import finalize_grads, grads_finite
from megaloop.train.metrics import MetricsLogger, nonfinite_warning, prior_metrics, renew_wandb_id
from megaloop.train.run_dir import (RunDirLock, check_fresh_start, check_resume_source, check_run_dir_location,
                                    check_saved_layout, check_saved_optim, check_saved_seeds, init_only_changes,
                                    finish_interrupted_publish, keep_init_fields, set_aside_newer, vocab_hint)
from megaloop.train.run_files import init_tokenizer_warning, keep_tokenizer, record_data, recorded_content
from megaloop.train.schedule import build_scheduler
from megaloop.train.val_set import check_val_manifest, mixval_plan, read_val_batches


class NonFiniteLossError(RuntimeError):
    pass


def _fresh_counters() -> dict:
    """Run totals kept in every metrics record and checkpoint (exact across resumes)."""
    return {"model_flops_total": 0.0, "target_tokens_total": 0, "skipped_steps_total": 0, "depth_counts": {}}


def _copy_counters(c: dict) -> dict:
    out = dict(c)
    out["depth_counts"] = {k: int(v) for k, v in sorted(c["depth_counts"].items(), key=lambda kv: int(kv[0]))}
    return out


class Trainer:
    """Builds everything from a :class:`RunConfig` and trains. ``run()`` returns the exit code."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, resume: str | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.resume = resume

    # ================================================================ setup
    def setup(self) -> None:
        cfg = self.cfg
        cfg.check_trainable()
        par = cfg.parallel
        self.dims = ParallelDims(world=world_size_from_env(), tp=par.tp, pp=par.pp, vpp=par.vpp)
        init_distributed(self.dims, cfg.train.seed)
        self.rank = torch.distributed.get_rank()
        self.device = compute_device()  # model, batches and collective buffers (NCCL: the GPU)
        # checkpoint to resume and the depth sampler first: a bad --resume path or depth.init=from:PATH
        # fails before data and model are built (a resumed run's checkpoint brings its own prior)
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", keep=cfg.train.keep_checkpoints)
        check_run_dir_location(self.run_dir, {"data.path": cfg.data.path, "data.val_path": cfg.data.val_path})
        self._lock = RunDirLock(self.run_dir)
        self._lock.acquire(self.rank, held=lambda: finish_interrupted_publish(self.ckpt))  # released when run() ends
        resume_path = self.ckpt.resolve(self.resume) if self.resume else None
        if self.resume is None:
            check_fresh_start(self.ckpt, self.run_dir)
        elif resume_path is not None:
            check_resume_source(self.ckpt, self.run_dir, resume_path)
        init_path = None
        if cfg.train.init_weights and resume_path is None:  # a resumed run's checkpoint brings its weights
            from megaloop.train.checkpoint import CheckpointError, find_checkpoint

            try:
                init_path = find_checkpoint(cfg.train.init_weights)
            except CheckpointError as err:
                raise CheckpointError(f"train.init_weights: {err}") from None
            self._check_saved_model(init_path, self.ckpt.saved_model_config(init_path), "start from it with",
                                    resume=False)
        init_state = None
        if cfg.depth.kind == "learned" and cfg.depth.init_from is not None and resume_path is None:
            from megaloop.train.prior_init import load_prior_init

            init_state = load_prior_init(cfg.depth.init_from, cfg.depth.r_max)
        self.sampler = DepthSampler(cfg.depth, cfg.train.seed, init_state=init_state)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp = parallel_state.get_data_parallel_world_size()
        self.M = cfg.train.num_microbatches(self.dp)
        if (par.vpp or 1) > 1 and self.M % par.pp:
            raise ConfigError(f"train.global_batch_size: interleaved pipelining needs the {self.M} microbatches "
                              f"per step to be a multiple of parallel.pp={par.pp}")
        self.mbs = cfg.train.micro_batch_size
        self.seq = cfg.model.seq_len

        from megaloop.data import build_train_loader
        from megaloop.data.errors import DataError

        shield_resource_tracker()  # before the loader registers shared memory with it
        try:
            self.loader = build_train_loader(cfg.data, seq_len=self.seq, micro_batch_size=self.mbs,
                                             dp_rank=self.dp_rank, dp_size=self.dp, seed=cfg.train.seed,
                                             hashes_verified=True)  # by _verify_data
        except DataError as err:
            raise DataError(f"data.path={cfg.data.path}: {err}") from None
        manifest = getattr(self.loader, "manifest", {}) or {}
        self.vocab = cfg.model.vocab_size or int(manifest.get("vocab_size", 0))
        if self.vocab <= 0:
            raise ConfigError("model.vocab_size: not set and the data manifest has no vocab_size")
        if manifest.get("vocab_size") and self.vocab < int(manifest["vocab_size"]):
            raise ConfigError(f"model.vocab_size: {self.vocab} is smaller than the tokenizer's "
                              f"{manifest['vocab_size']} (data manifest)")
        # the embedded default ships its own validation split; other data name it in data.val_path
        self.val_path, self.val_seq = self._resolve_val(
            cfg.data.val_path or ("default" if cfg.data.path == "default" else None), manifest)
        self._verify_data()  # after the manifests' checks above, before the model is built
        if self.val_path is None and self.rank == 0:
            print(f"note: data.val_path is not set: this run on {cfg.data.path} reports no validation loss "
                  "(build a validation set with data_prep/build_eval_sets.py)", flush=True)
        if par.sequence_parallel and par.tp == 1 and self.rank == 0:  # as Megatron-LM: dropped with a word
            print("note: parallel.sequence_parallel=true has no effect at parallel.tp=1; training without it",
                  flush=True)

        self.model, self.tc = build_model(
            cfg.model, vocab_size=self.vocab, tp=par.tp, pp=par.pp, vpp=par.vpp,
            sequence_parallel=par.sequence_parallel, seed=cfg.train.weights_seed, ddp=True,
            distributed_optimizer=par.distributed_optimizer)
        if init_path is not None:  # before the optimizer, whose main copies are made from these weights
            from megaloop.train.checkpoint import CheckpointError

            try:
                self.ckpt.load(init_path, self.model)
            except CheckpointError as err:
                hint = vocab_hint(err, self.vocab, cfg, self.ckpt.saved_model_config(init_path))  # another padding
                raise CheckpointError(f"train.init_weights: {err}{hint}") from None  # multiple named, not the tokenizer
            if self.rank == 0:
                print(f"model weights from {init_path} (train.init_weights); optimizer, schedule, depth sampler "
                      "and data order start at step 0", flush=True)
                if warn := init_tokenizer_warning(init_path, self.ckpt.saved_config(init_path), manifest,
                                                  self.loader.path):
                    print(f"warning: {warn}", file=sys.stderr, flush=True)
        self.tc.finalize_model_grads_func = finalize_grads
        self.tc.no_sync_func = [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        o = cfg.optim
        ocfg = OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                               adam_beta1=o.beta1, adam_beta2=o.beta2, adam_eps=o.eps,
                               clip_grad=o.clip_grad, bf16=cfg.model.bf16,
                               params_dtype=torch.bfloat16 if cfg.model.bf16 else torch.float32,
                               use_distributed_optimizer=par.distributed_optimizer)
        from megatron.core.optimizer import get_standard_config_overrides

        overrides = get_standard_config_overrides(ocfg)
        overrides[ParamKey(attr="no_weight_decay")] = {"wd_mult": 0.0}  # Δ_raw, α_log, W (SPEC §2)
        self.optimizer = get_megatron_optimizer(ocfg, self.model, config_overrides=overrides)
        self.scheduler = build_scheduler(self.optimizer, o, cfg.train.max_steps)
        self.step, self.tokens, self.nonfinite_run = 0, 0, 0
        self.counters = _fresh_counters()
        self.last_saved = -1
        if resume_path is not None:
            self._load(resume_path)

        def first_batch() -> None:  # read now: a shard that cannot be read stops every rank before the run dir
            try:
                self.loader.warm()
            except DataError as err:
                raise DataError(f"data.path={cfg.data.path}: {err}") from None
            if self.val_path is not None:  # and the validation batches (bad ids, undecodable samples)
                read_val_batches(self._val_loader(), cfg.data.val_path)

        on_every_rank(first_batch)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            cfg.dump(self.run_dir / "config.yaml")
            keep_tokenizer(self.run_dir, manifest, self.loader.path, cfg.data.path)
            record_data(self.run_dir, self.loader.path, manifest, self.loader.content())
        self.peak = device_peak_tflops(cfg.train.peak_tflops)
        self.metrics = MetricsLogger(self.run_dir, cfg.logging, enabled=self.rank == 0,
                                     total_steps=self._end_step(), start_step=self.step,
                                     config_dict=cfg.to_dict(), rewound=getattr(self, "rewound", False))
        self.loader_iter = iter(self.loader)

    def _verify_data(self) -> None:
        """The shards of the training and validation sets against their ``index.json`` hashes before any
        loader reads them: the ranks of a machine share the hashing (1 in ``LOCAL_WORLD_SIZE`` each), and a
        damaged shard found by any rank stops every rank with one DataError naming it (``on_every_rank``)."""
        from megaloop.data.errors import DataError
        from megaloop.data.loaders import resolve_data_path
        from megaloop.data.streaming import verify_dataset

        d = self.cfg.data
        local = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        part = local if 0 <= local[0] < local[1] else (0, 1)

        def check() -> None:  # the embedded set too: a damaged shard of it was named after the run dir was written
            for field, path, split in (("data.path", d.path, "train"), ("data.val_path", self.val_path, "val")):
                if path:
                    try:
                        verify_dataset(resolve_data_path(str(path), self.seq, d.cache_dir, split), d.cache_dir,
                                       d.validate_hash, part=part)
                    except (DataError, OSError) as err:
                        raise DataError(f"{field}={path}: {err}") from None

        on_every_rank(check)

    def _resolve_val(self, path: str | None, train_manifest: dict) -> tuple[str | None, int]:
        """Validation set and its sequence length (may be shorter than the model's: RoPE), checked
        against the training data (:mod:`megaloop.train.val_set`)."""
        if not path:
            return None, self.seq
        from megaloop.data.config import embedded_split
        from megaloop.data.errors import DataError
        from megaloop.data.loaders import resolve_data_path
        from megaloop.data.streaming import load_manifest

        embedded = embedded_split(str(path), "val") is not None  # not a folder named default_...
        if embedded and embedded_split(str(self.cfg.data.path), "train") is not None:
            return str(path), self.seq
        try:  # an embedded split beside another training set: its tokenizer is checked (it scored other ids)
            where = resolve_data_path(str(path), self.seq, self.cfg.data.cache_dir, "val") if embedded else str(path)
            manifest = load_manifest(where, self.cfg.data.cache_dir)
        except DataError as err:
            raise DataError(f"data.val_path={path}: {err}") from None
        seq, warnings = check_val_manifest(str(path), manifest, str(self.cfg.data.path), train_manifest,
                                           seq_len=self.seq, micro_batch_size=self.mbs, fp8=self.cfg.model.fp8)
        if warnings and self.rank == 0 and not embedded:  # another corpus: the holdout warnings do not apply
            print("\n".join(f"warning: {line}" for line in warnings), file=sys.stderr, flush=True)
        return str(path), self.seq if embedded else seq

    def _end_step(self) -> int:
        t = self.cfg.train
        return min(t.max_steps, t.stop_after) if t.stop_after else t.max_steps

    # ================================================================ checkpoints
    def _common(self, before_step: dict | None = None) -> dict:
        """What a checkpoint holds besides weights and optimizer; ``before_step``: the loader and
        scheduler states taken before a step that was then abandoned (``train_step``'s non-finite
        abort), so the checkpoint resumes at that step, not after it."""
        pre = before_step or {}
        states = [None] * self.dp
        torch.distributed.all_gather_object(states, pre.get("loader") or self.loader.state_dict(),
                                            group=parallel_state.get_data_parallel_group())
        return {"step": self.step, "tokens": self.tokens,
                "scheduler": pre.get("scheduler") or self.scheduler.state_dict(),
                "sampler": self.sampler.state_dict(), "loader": states,
                "nonfinite_run": self.nonfinite_run - (1 if before_step else 0),  # the abandoned step: retrained
                "counters": _copy_counters(self.counters), "config": self.cfg.to_dict()}

    def save(self, before_step: dict | None = None) -> Path:
        self._lock.check_held(f"saving step {self.step}")  # a deleted run dir was recreated by the save
        try:
            path = self.ckpt.save(self.step, self.model, self.optimizer, self._common(before_step))
        except CheckpointSaveError:  # the folder may have gone during the save (the cause, not ENOENT); no
            self._lock.check_held(f"saving step {self.step}", collective=False)  # collective: peers may be in the save
            raise
        self.last_saved = self.step
        self.metrics.message(f"saved checkpoint {path}")
        return path

    def _load(self, path: Path) -> None:
        from megaloop.train.checkpoint import CheckpointError

        check_saved_layout(path, self.ckpt.saved_config(path), self.cfg)  # what the load would fail on unnamed
        try:
            common = self.ckpt.load(path, self.model, self.optimizer)
        except CheckpointError as err:
            saved = self.ckpt.saved_model_config(path)
            self._check_saved_model(path, saved)  # name the field if it is one
            if hint := vocab_hint(err, self.vocab, self.cfg, saved):
                raise CheckpointError(f"{err}{hint}") from None
            raise
        self._check_saved_model(path, (common.get("config") or {}).get("model") or {})
        check_saved_optim(path, (common.get("config") or {}).get("optim") or {}, self.cfg.optim)
        check_saved_seeds(path, common.get("config") or {}, self.cfg)
        self.step, self.tokens = int(common["step"]), int(common["tokens"])
        self.nonfinite_run = int(common.get("nonfinite_run", 0))
        # checkpoints older than the counters: totals restart here and say from which step they count
        self.counters = _copy_counters(common["counters"]) if "counters" in common else \
            dict(_fresh_counters(), counted_from_step=self.step)
        old_horizon = int(common["scheduler"]["lr_decay_steps"])
        if old_horizon != self.cfg.train.max_steps:
            # megatron's scheduler keeps the checkpoint's horizon (and not its WSD decay length):
            # a longer train.max_steps would train at lr=0. Honour the new horizon where the LR
            # curve stays continuous, else refuse (schedule.check_horizon_change).
            from megaloop.train.schedule import check_horizon_change

            problem = check_horizon_change(self.cfg.optim, old_horizon, self.cfg.train.max_steps,
                                           int(common["scheduler"]["num_steps"]))
            if problem:
                raise ConfigError(f"{problem} (checkpoint {path})")
            self.scheduler.num_steps = int(common["scheduler"]["num_steps"])
            self.horizon_changed_from = old_horizon
        else:
            self.scheduler.load_state_dict(common["scheduler"])
        self.sampler.load_state_dict(common["sampler"])
        states = common["loader"]
        state = states[self.dp_rank] if len(states) == self.dp else states[0]
        if "order" not in state and isinstance((common.get("config") or {}).get("data"), dict):
            from megaloop.data.loaders import sample_order  # a checkpoint saved before the state kept it

            state = {**state, "order": sample_order(common["config"]["data"])}
        self.loader.load_state_dict(state, recorded_content(Path(path).parent.parent,
                                                            state.get("dataset_fingerprint")))
        if self.loader.rebuilt and self.rank == 0:
            print(f"note: {self.loader.path} was rebuilt since the checkpoint (new build fingerprint) with "
                  "identical shard content: resuming on it", flush=True)
        self.last_saved = self.step
        if self.rank == 0 and (note := init_only_changes(common.get("config") or {}, self.cfg)):
            print(note, flush=True)  # after every refusal the load can still raise
        keep_init_fields(common.get("config") or {}, self.cfg)  # config.yaml: the run's own initial state
        if self.rank == 0:
            for moved in set_aside_newer(self.ckpt, path, on_rewind=self._rewind):
                print(f"resuming from an older step: {moved.name} moved to {moved.parent} (kept, not pruned)",
                      flush=True)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        if self.rank == 0:
            changed = getattr(self, "horizon_changed_from", None)
            note = f" (schedule horizon {changed} -> {self.cfg.train.max_steps})" if changed else ""
            print(f"resumed from {path} at step {self.step}{note}", flush=True)

    def _rewind(self) -> None:
        """Another line of history than the newest checkpoint's: a new wandb run (one keeps only increasing
        steps), its id set before any checkpoint moves (a launch stopped in between continued the old one)."""
        self.rewound = True
        renew_wandb_id(self.run_dir, self.cfg.logging.name)

    def _check_saved_model(self, path: Path, saved: dict, advice: str = "resume it with", resume: bool = True) -> None:
        """Refuse a checkpoint trained under other values of the model-defining fields (a changed
        default included, e.g. ``model.qk_norm`` before it became the default), naming each field
        and the overrides that resume it; a field the saved config lacks counts as what runs
        before it trained with (``ModelConfig.LEGACY_DEFAULTS``). ``resume=False`` (train.init_weights):
        ``ModelConfig.RESUME_FIELDS`` may change."""
        from megaloop.model.config import arch_differences, as_override, describe_differences

        diffs = arch_differences(saved, self.cfg.model, resume) if saved else []
        if diffs:
            keep = " ".join(as_override(k, old) for k, old, _ in diffs)
            raise ConfigError(f"checkpoint {path} was trained as another model "
                              f"({describe_differences(diffs, 'checkpoint', 'this run')}); {advice} {keep}")

    # ================================================================ step pieces
    def _microbatches(self, step: int, depths: list[int], loader_iter) -> list[dict]:
        out = []
        for i, r in enumerate(depths):
            batch = next(loader_iter)
            # streaming hands sample k of a global batch to data-parallel rank k % dp; keying h⁰ on
            # that global position makes the draw independent of the DP size
            seeds = [stable_seed(self.cfg.train.seed, "h0", step, i, j * self.dp + self.dp_rank)
                     for j in range(self.mbs)]
            out.append(dict(self._to_device(batch), depth=r, noise_seed=seeds, index=i))
        return out

    def _to_device(self, batch: dict) -> dict:
        """Batch tensors onto this rank's device (pinned host memory: asynchronous copies)."""
        nb = self.device.type == "cuda"
        return {k: v.to(self.device, non_blocking=nb) if torch.is_tensor(v) else v for k, v in batch.items()}

    def _forward_step(self, data_iterator, model):
        mb = next(data_iterator)
        core = unwrap(model)
        out = model(mb["tokens"] if core.pre_process else None,
                    labels=mb["labels"] if core.post_process else None,
                    depth=mb["depth"], noise_seed=mb["noise_seed"])
        return out, partial(self._loss_func, mb)

    def _loss_func(self, mb: dict, output: torch.Tensor):
        mask = mb["loss_mask"].to(torch.float32)
        ce_sum = (output.float() * mask).sum()
        n = mask.sum()
        self._ce[mb["index"], 0] += ce_sum.detach().double()
        self._ce[mb["index"], 1] += n.double()
        if getattr(self, "_src", None) is not None and "source_idx" in mb:  # validation: per source
            rows = mb["source_idx"] >= 0
            per_row = torch.stack([(output.detach().float() * mask).sum(1), mask.sum(1)], 1).double()
            self._src.index_add_(0, mb["source_idx"][rows], per_row[rows])
        return ce_sum, n.to(torch.int), {"lm loss": torch.stack([ce_sum.detach(), n])}

    def _run_schedule(self, mbs: list[dict], forward_only: bool, seq_len: int | None = None) -> torch.Tensor:
        """Run megatron's schedule over ``mbs``; returns global [M, 2] (CE sum, tokens) per
        microbatch, float64 on the CPU (a host synchronisation: the prior update needs it)."""
        self._ce = torch.zeros(len(mbs), 2, dtype=torch.float64, device=self.device)
        seq = (seq_len or self.seq) * (2 if self.cfg.model.looped and self.dims.pp > 1 else 1)
        iters = [iter(mbs) for _ in self.model]
        get_forward_backward_func()(
            forward_step_func=self._forward_step, data_iterator=iters if len(iters) > 1 else iters[0],
            model=self.model, num_microbatches=len(mbs), seq_length=seq,
            micro_batch_size=self.mbs, forward_only=forward_only)
        return self._reduce(self._ce)

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over data-parallel ranks and share from the last pipeline stage; float64 on the CPU."""
        torch.distributed.all_reduce(t, group=parallel_state.get_data_parallel_group())
        if self.dims.pp > 1:
            torch.distributed.all_reduce(t, group=parallel_state.get_pipeline_model_parallel_group())
        return t.cpu()

    # ================================================================ train step
    def train_step(self) -> dict:
        cfg, step = self.cfg, self.step
        t0 = time.perf_counter()
        depths = self.sampler.plan(step, self.M)
        if step % max(cfg.train.log_interval, 1) == 0:
            assert_plan_synchronised(depths)
        # a non-finite abort saves the state before this step (the batches it took, the LR it set)
        self._before_step = {"loader": self.loader.state_dict(), "scheduler": self.scheduler.state_dict()}
        # a bad batch met on one rank (DataError) stops every rank with its message
        mbs = on_every_rank_each_step(lambda: self._microbatches(step, depths, self.loader_iter), self.device)
        self.scheduler.step(increment=1)  # LR of update step+1 (see schedule.py)
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        ce = self._run_schedule(mbs, forward_only=False)
        ce_sums, counts = ce[:, 0], ce[:, 1]
        loss = float(ce_sums.sum() / counts.sum().clamp_min(1))
        rec: dict = {"step": step + 1, "loss": loss, "depths": depths}
        # a finite loss can still give a non-finite gradient (an overflow in backward): checked too
        finite = math.isfinite(loss) and grads_finite(self.model)
        if not finite:
            self.nonfinite_run += 1
            rec.update(skipped=1, nonfinite_run=self.nonfinite_run)
            what = "loss" if not math.isfinite(loss) else f"gradient (loss {loss:.4g})"
            if cfg.train.nonfinite == "abort" or self.nonfinite_run > cfg.train.max_nonfinite:
                raise NonFiniteLossError(
                    f"non-finite {what} at step {step + 1} (policy train.nonfinite={cfg.train.nonfinite}, "
                    f"{self.nonfinite_run} in a row; limit train.max_nonfinite={cfg.train.max_nonfinite})")
            grad_norm = float("nan")
        else:
            self.nonfinite_run = 0
            ok, grad_norm, _ = self.optimizer.step()
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            rec.update(prior_metrics(self.sampler, self.sampler.update(depths, ce_sums, counts)))
        self.step += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the step's kernels are done before its time is taken
        step_tokens = int(counts.sum().item()) if finite else 0
        gtokens = cfg.train.global_batch_size * self.seq
        self.tokens += gtokens
        dt = time.perf_counter() - t0
        flops = sum(microbatch_flops(cfg.model, unwrap(self.model[0]).vocab_size, self.seq,
                                     self.mbs * self.seq * self.dp, r, cfg.model.bptt_window) for r in depths)
        tflops = flops / dt / self.dims.world / 1e12
        c = self.counters
        c["model_flops_total"] += flops
        c["target_tokens_total"] += step_tokens
        c["skipped_steps_total"] += 0 if finite else 1
        for r in depths:
            c["depth_counts"][str(r)] = c["depth_counts"].get(str(r), 0) + 1
        rec.update(tokens=self.tokens, target_tokens=step_tokens, lr=self.optimizer.param_groups[0]["lr"],
                   grad_norm=grad_norm, mean_depth=sum(depths) / len(depths), step_time_s=dt,
                   tokens_per_s=gtokens / dt, tflops=tflops, model_flops=flops, **_copy_counters(c))
        if self.peak:
            rec["mfu"] = tflops / self.peak
        if torch.cuda.is_available():
            rec["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return rec

    # ================================================================ eval
    @cached_property
    def _val_plan(self) -> tuple[list[int], list[str], list[int]]:
        """The MixVal plan (:func:`megaloop.train.val_set.mixval_plan`), computed once."""
        return mixval_plan(self.val_path, self.val_seq, self.cfg.data.cache_dir,
                           self.cfg.train.eval_batches * self.cfg.train.global_batch_size)

    def _val_loader(self):
        from megaloop.data import build_eval_loader

        return build_eval_loader(self.val_path, seq_len=self.val_seq, micro_batch_size=self.mbs,
                                 dp_rank=self.dp_rank, dp_size=self.dp, cache_dir=self.cfg.data.cache_dir,
                                 mask_document_boundaries=self.cfg.data.mask_document_boundaries,  # as trained
                                 indices=self._val_plan[0], hashes_verified=True)  # by _verify_data

    def evaluate(self, depth: int | None = None) -> dict:
        """Validation CE at ``depth`` (default ``train.eval_depth``) on the MixVal plan, with its
        per-source breakdown (``val_ce_per_source``, token-weighted within each source)."""
        if self.val_path is None:
            return {}
        depth = depth or self.cfg.train.eval_depth
        order, names, src_ids = self._val_plan
        loader = self._val_loader()
        mbs = []
        for i, (batch, rows) in enumerate(zip(loader, loader.rank_rows())):
            ids = torch.tensor([src_ids[j] if j >= 0 else -1 for j in rows], dtype=torch.long)
            mbs.append(dict(self._to_device(batch), depth=depth, noise_seed=None, index=i,
                            source_idx=ids.to(self.device)))
        loader.close()
        group = self.dims.pp if (self.dims.vpp or 1) > 1 else 1  # interleaving runs whole groups
        while mbs and len(mbs) % group:  # pad with fully masked copies (they count zero tokens)
            pad = dict(mbs[-1], index=len(mbs), loss_mask=torch.zeros_like(mbs[-1]["loss_mask"]))
            mbs.append(pad)
        for m in self.model:
            m.eval()
        self._src = torch.zeros(len(names), 2, dtype=torch.float64, device=self.device)
        try:
            with torch.no_grad():
                ce = self._run_schedule(mbs, forward_only=True, seq_len=self.val_seq) if mbs else None
                src = self._reduce(self._src)
        finally:
            self._src = None
            for m in self.model:
                m.train()
        if ce is None:
            return {}
        val = float(ce[:, 0].sum() / ce[:, 1].sum().clamp_min(1))
        per_source = {n: float(src[k, 0] / src[k, 1]) for k, n in enumerate(names) if src[k, 1] > 0}
        return {"val_ce": val, "val_ppl": math.exp(min(val, 50.0)), "val_depth": depth,
                "val_ce_per_source": per_source, "val_sequences": len(order)}

    # ================================================================ loop
    def close(self, refused: bool = False) -> None:
        """Release the run directory (also done by ``run``); ``refused`` (set-up failed): a run
        directory this run created and left empty is removed."""
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.release(discard_unused=refused)

    def run(self) -> int:
        """Train to the end step. Exit codes: 0 done; 75 (EXIT_REQUEUE) stopped by SIGTERM/SIGUSR1
        after a checkpoint (resume me); 130 stopped by Ctrl-C after a checkpoint. A signal that
        arrives during the last step (or its save) ends the run normally: it is complete."""
        try:
            self.setup()  # Ctrl-C here interrupts at once: nothing to save yet
        except BaseException:
            self.close(refused=True)
            raise
        stop = SignalStop(lead=self.rank == 0).__enter__()  # left in the finally below
        code = EXIT_OK
        try:
            t = self.cfg.train
            end = self._end_step()
            self.metrics.message(size_line(self.cfg.model, self.vocab))  # as `megaloop plan` counts them
            if self.step >= end:  # a resumed run that already reached its end (a finished screen point: fine)
                limit = f"train.stop_after={t.stop_after}" if t.stop_after and t.stop_after < t.max_steps else \
                    f"train.max_steps={t.max_steps}"
                self.metrics.message(f"nothing to train: the checkpoint's step {self.step} is at or past {limit}")
            rec: dict | None = None
            while self.step < end:
                try:
                    rec = self.train_step()
                except NonFiniteLossError as err:
                    if self.last_saved == self.step:  # never re-save over a good checkpoint
                        self.metrics.message(f"aborting: {err}; the last finite state (step {self.step}) "
                                             "is already saved")
                    else:
                        last = self.step - (self.nonfinite_run - 1)  # train.nonfinite=skip: skipped steps before
                        self.metrics.message(f"aborting: {err}; saving the last finite state (step {self.step})"
                                             if last == self.step else f"aborting: {err}; saving step {self.step} "
                                             f"(the weights of step {last}, the last finite update; the batches "
                                             "of the skipped steps are not retrained)")
                        self.save(before_step=self._before_step)
                    raise
                evaluated = bool(t.eval_interval and self.step % t.eval_interval == 0) or self.step == end
                if evaluated:
                    rec.update(self.evaluate())
                if self.step % max(t.log_interval, 1) == 0 or evaluated:  # every evaluation is logged
                    self.metrics.log(rec)
                if t.save_interval and self.step % t.save_interval == 0 and self.step != end:
                    self.save()
                # checked after the save, so a signal that arrived during it costs no further step
                sig = stop.agreed() if self.step < end else 0
                if sig:
                    how = "interrupted" if sig == signal.SIGINT else "signal received"
                    self.metrics.message(f"{how}: checkpointing at step {self.step} and exiting")
                    code = exit_code(sig)
                    break
            if self.last_saved != self.step:
                self.save()
            if code == EXIT_OK and (warn := nonfinite_warning(self.counters, self.step, self.nonfinite_run, rec)):
                self.metrics.message(warn)  # a run that ended diverged said nothing, exit 0
            if code == EXIT_OK and stop.received:
                self.metrics.message(f"signal received during the last step: the run is complete at step {self.step}")
        finally:
            stop.__exit__(None, None, None)
            self.metrics.close()
            self.close()
        return code
