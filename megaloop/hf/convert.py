"""megaloop checkpoint ⇄ Hugging Face folder (``trust_remote_code``), validated numerically.

``convert_to_hf(checkpoint, out)`` reads a megaloop training checkpoint written at any TP/PP
layout (checkpoint keys are layout-independent, so it is loaded into a TP=1/PP=1 native model in
this one process), maps the weights onto :mod:`megaloop.hf.modeling_megaloop`, and writes
(beside ``out``, renamed into place when complete)::

    out/config.json                  MegaloopConfig + auto_map (AutoConfig, AutoModel, AutoModelForCausalLM)
    out/model.safetensors            (or model-0000x-of-0000n.safetensors + index above ~2 GB)
    out/*_megaloop.py                the model code (CODE_FILES; imports only torch + transformers)
    out/generation_config.json       eos/bos/pad; padded vocab ids suppressed
    out/tokenizer.json, tokenizer_config.json, special_tokens_map.json   (when a tokenizer is found)
    out/megaloop_conversion.json     source checkpoint, step, validation errors

Weight mapping (megatron local spec → HF):
  ``embedding.word_embeddings.weight`` → ``model.embed_tokens.weight``;
  ``{prelude,core,coda,layers}.i.`` → ``model.{prelude,core,coda,layers}.i.``;
  ``input_layernorm`` → ``input_layernorm``; ``pre_mlp_layernorm`` → ``post_attention_layernorm``;
  fused ``self_attention.linear_qkv.weight`` ``[g·(n/g + 2)·hd, d]`` (per query group: its n/g
  query heads, then k, then v) → split into ``self_attn.q_proj`` (heads ordered group by group),
  ``k_proj``, ``v_proj``; ``linear_qkv_inject`` (DEQ-QKV) likewise → ``q/k/v_inject``;
  ``linear_proj`` → ``o_proj``; ``mlp.linear_fc1`` = [gate; up] → ``gate_proj``, ``up_proj``;
  ``linear_fc2`` → ``down_proj``; ``self_attention.{q,k}_bias`` → ``self_attn.{q,k}_bias``;
  ``injection.*`` → ``model.injection.*``;
  ``state_readout.weight`` → ``model.state_readout.weight``; ``final_norm`` → ``model.norm``;
  ``output_layer.weight`` → ``lm_head.weight`` (tied: the embedding).
The split is exact (a reshape), so HF → megaloop (``hf_to_native_state_dict``) fuses them back.

Validation (:func:`megaloop.hf.validate.check_conversion`, default on here and in :func:`megaloop.hf.load.load_model`): native
vs HF logits in FP32, eval mode (both use the same eval-time state init), on random sequences at
the configured depth. The error is ``max|Δlogit| / max(1, max|native logit|)`` (absolute for
logits of unit scale, relative above) and must be ≤ ``TOLERANCE`` = 1e-4, else
:class:`ConversionError` names both errors.

Errors: a checkpoint that is missing, unreadable or inconsistent with its own config raises
:class:`~megaloop.train.checkpoint.CheckpointError`; a conversion that cannot be done or does not
reproduce the native model raises :class:`ConversionError`. Both are :class:`~megaloop.errors.UserError`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from megaloop.hf.configuration_megaloop import MegaloopConfig
from megaloop.hf.errors import ConversionError
from megaloop.hf.live_read import load_newest
from megaloop.hf.modeling_megaloop import MegaloopForCausalLM
from megaloop.hf.staging import put_back, staging_dir, sweep_stale
from megaloop.hf.tokenizer_files import check_embedded_corpus, save_tokenizer, tokenizer_info
from megaloop.hf.validate import TOLERANCE, check_conversion, check_reload
from megaloop.runtime.files import plain_mode
HF_DIR = Path(__file__).resolve().parent
CODE_FILES = ("configuration_megaloop.py", "cache_megaloop.py", "injection_megaloop.py", "adaptive_megaloop.py",
              "layers_megaloop.py", "modeling_megaloop.py")
AUTO_MAP = {"AutoConfig": "configuration_megaloop.MegaloopConfig",
            "AutoModel": "modeling_megaloop.MegaloopModel",
            "AutoModelForCausalLM": "modeling_megaloop.MegaloopForCausalLM"}
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


# ============================================================================ checkpoint reading
def _read(ckpt: Path, what: str, reader):
    """``reader(str(ckpt))``; any failure (torch's CheckpointException is a BaseException) as CheckpointError
    naming the damaged files when they can be found (an empty ``common.pt``, a short ``*.distcp``)."""
    from megaloop.train.checkpoint import CheckpointError, _load_failure

    try:
        return reader(str(ckpt))
    except BaseException as err:
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"checkpoint {ckpt}: {what} could not be read: {_load_failure(err, ckpt)}") from err


def read_common(ckpt: Path) -> dict:
    """The checkpoint's ``common`` state (step, config, ...)."""
    from megatron.core import dist_checkpointing

    return _read(ckpt, "common.pt", dist_checkpointing.load_common_state_dict).get("common") or {}


def read_run_config(ckpt: Path, common: dict | None = None) -> dict:
    """The run config dict: ``common["config"]``, else ``RUN_DIR/config.yaml``."""
    from megaloop.train.checkpoint import CheckpointError

    common = read_common(ckpt) if common is None else common
    cfg = common.get("config")
    if cfg is None:
        yaml_path = ckpt.parent.parent / "config.yaml"
        if yaml_path.is_file():
            import yaml

            cfg = yaml.safe_load(yaml_path.read_text())
        else:
            raise CheckpointError(f"checkpoint {ckpt}: no run config (common state has no 'config' "
                                  f"and {yaml_path} does not exist)")
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise CheckpointError(f"checkpoint {ckpt}: run config has no 'model' section; not a megaloop run config")
    return cfg


def model_config_from_run(run_cfg: dict, where: str):
    """``ModelConfig`` of a run config dict, set up to load on this machine (local spec, no FP8)."""
    from megaloop.config_utils import ConfigError, from_dict
    from megaloop.model.config import ModelConfig, with_legacy_defaults
    from megaloop.train.checkpoint import CheckpointError

    try:
        model = with_legacy_defaults(run_cfg["model"])  # runs from before a field: what they trained with
        mcfg = from_dict(ModelConfig, model, "model")
    except ConfigError as err:
        raise CheckpointError(f"checkpoint {where}: run config is not a megaloop model config: {err}") from None
    mcfg.transformer_impl = "local"
    mcfg.fp8 = None
    mcfg.bf16 = False  # FP32 native model (bf16 checkpoint tensors are upcast on load)
    return mcfg


def checkpoint_vocab(ckpt: Path) -> int:
    """Padded vocabulary (rows of the stored embedding)."""
    from megatron.core import dist_checkpointing

    from megaloop.train.checkpoint import CheckpointError

    meta = _read(ckpt, "tensor metadata", dist_checkpointing.load_tensors_metadata)
    key = "embedding.word_embeddings.weight"
    if key not in meta:
        raise CheckpointError(f"checkpoint {ckpt} holds no {key}: not a megaloop LoopedGPT checkpoint "
                              f"(tensors: {', '.join(sorted(meta)[:5])}...)")
    return int(meta[key].global_shape[0])


def _describe(mcfg) -> str:
    return (f"config: arch={mcfg.arch}, injection={mcfg.injection}, hidden={mcfg.hidden_size}, "
            f"layers={mcfg.physical_layers}")


# ============================================================================ native model
def load_native(checkpoint: str | Path, *, seed: int | None = None):
    """A checkpoint in a TP=1/PP=1 FP32 native model in eval mode (a run's that may be training there:
    :func:`megaloop.hf.live_read.load_newest`): ``(LoopedGPT, ModelConfig, run_cfg, ckpt, common)``.
    Starts a 1-process torch.distributed/megatron world if none is running. A missing, incomplete
    or inconsistent checkpoint raises :class:`~megaloop.train.checkpoint.CheckpointError`.
    """
    from megatron.core import parallel_state

    from megaloop.model.build import build_model, unwrap
    from megaloop.runtime.parallel import ParallelDims, init_distributed
    from megaloop.train.checkpoint import CheckpointError, CheckpointManager, find_checkpoint, verify_model_tensors

    ckpt = find_checkpoint(checkpoint)
    common = read_common(ckpt)
    run_cfg = read_run_config(ckpt, common)
    mcfg = model_config_from_run(run_cfg, str(ckpt))
    vocab = checkpoint_vocab(ckpt)
    if mcfg.padded_vocab(vocab) != vocab:
        raise CheckpointError(f"checkpoint {ckpt}: embedding has {vocab} rows, not a multiple of "
                              f"model.vocab_pad_multiple={mcfg.vocab_pad_multiple}")
    if seed is None:
        seed = int((run_cfg.get("train") or {}).get("seed", 1234))
    if not (torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized()):
        init_distributed(ParallelDims(world=1), seed)
    if (parallel_state.get_tensor_model_parallel_world_size() != 1
            or parallel_state.get_pipeline_model_parallel_world_size() != 1):
        raise ConversionError("conversion needs a TP=1/PP=1 world (run it in a plain single process)")
    chunks, _ = build_model(mcfg, vocab_size=vocab, tp=1, pp=1, vpp=None, sequence_parallel=False,
                            seed=seed, ddp=False)
    try:
        verify_model_tensors(ckpt, chunks)
        CheckpointManager(ckpt.parent).load(ckpt, chunks, optimizer=None)
    except CheckpointError as err:  # the same error, with the config it was checked against
        raise CheckpointError(f"{err} ({_describe(mcfg)})") from None
    except RuntimeError as err:  # load_state_dict shape/key mismatch
        raise CheckpointError(f"checkpoint {ckpt} does not match its model config ({_describe(mcfg)}): "
                              f"{err}") from err
    native = unwrap(chunks[0]).float().eval()
    return native, mcfg, run_cfg, ckpt, common


# ============================================================================ weight mapping
def _split_qkv(w: torch.Tensor, heads: int, groups: int, hd: int) -> tuple[torch.Tensor, ...]:
    per = heads // groups
    w = w.reshape(groups, per + 2, hd, -1)
    q = w[:, :per].reshape(heads * hd, -1)
    k = w[:, per].reshape(groups * hd, -1)
    v = w[:, per + 1].reshape(groups * hd, -1)
    return q.contiguous(), k.contiguous(), v.contiguous()


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int, hd: int) -> torch.Tensor:
    per = heads // groups
    d = q.shape[-1]
    return torch.cat([q.reshape(groups, per, hd, d), k.reshape(groups, 1, hd, d),
                      v.reshape(groups, 1, hd, d)], dim=1).reshape(-1, d).contiguous()


_LAYER_MAP = {  # native suffix -> HF suffix (1:1)
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.q_bias": "self_attn.q_bias",  # qk_bias
    "self_attention.k_bias": "self_attn.k_bias",
    "post_attn_norm.weight": "post_attn_norm.weight",  # sandwich_norm
    "post_mlp_norm.weight": "post_mlp_norm.weight",
}
_GROUPS = ("prelude", "core", "coda", "layers")


def native_to_hf_state_dict(native_sd: dict[str, Any], mcfg) -> dict[str, torch.Tensor]:
    """HF state dict (``MegaloopForCausalLM``) from a LoopedGPT (local spec) state dict."""
    heads, groups, hd = mcfg.num_heads, mcfg.groups, mcfg.hidden_size // mcfg.num_heads
    out: dict[str, torch.Tensor] = {}
    for name, t in native_sd.items():
        if name.endswith("_extra_state") or t is None:
            continue
        t = t.detach()
        group = name.split(".", 1)[0]
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t
        elif name == "final_norm.weight":
            out["model.norm.weight"] = t
        elif name == "output_layer.weight":
            out["lm_head.weight"] = t
        elif group in ("injection", "state_readout"):
            out["model." + name] = t
        elif group in _GROUPS:
            _, idx, rest = name.split(".", 2)
            prefix = f"model.{group}.{idx}."
            if rest in _LAYER_MAP:
                out[prefix + _LAYER_MAP[rest]] = t
            elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv_inject.weight"):
                kind = "proj" if rest.endswith("linear_qkv.weight") else "inject"
                for n, part in zip("qkv", _split_qkv(t, heads, groups, hd)):
                    out[f"{prefix}self_attn.{n}_{kind}.weight"] = part
            elif rest == "mlp.linear_fc1.weight":
                gate, up = t.chunk(2, dim=0)
                out[prefix + "mlp.gate_proj.weight"] = gate.contiguous()
                out[prefix + "mlp.up_proj.weight"] = up.contiguous()
            else:
                raise ConversionError(f"native tensor {name!r} has no HF mapping")
        else:
            raise ConversionError(f"native tensor {name!r} has no HF mapping")
    if mcfg.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    elif "lm_head.weight" not in out:
        raise ConversionError("untied model without output_layer.weight")
    return out


def hf_to_native_state_dict(hf_sd: dict[str, torch.Tensor], cfg: MegaloopConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`native_to_hf_state_dict` (no ``_extra_state`` entries)."""
    heads, groups, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inv = {v: k for k, v in _LAYER_MAP.items()}
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in hf_sd.items():
        t = t.detach()
        if name == "model.embed_tokens.weight":
            out["embedding.word_embeddings.weight"] = t
        elif name == "model.norm.weight":
            out["final_norm.weight"] = t
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out["output_layer.weight"] = t
        elif name.startswith(("model.injection.", "model.state_readout.")):
            out[name[len("model."):]] = t
        else:
            _, group, idx, rest = name.split(".", 3)
            prefix = f"{group}.{idx}."
            if rest in inv:
                out[prefix + inv[rest]] = t
            elif rest.startswith("self_attn.") and rest.split(".")[1][0] in "qkv":
                n, kind = rest.split(".")[1].split("_")
                target = prefix + ("self_attention.linear_qkv.weight" if kind == "proj"
                                   else "self_attention.linear_qkv_inject.weight")
                pending.setdefault(target, {})[n] = t
            elif rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
                pending.setdefault(prefix + "mlp.linear_fc1.weight", {})[rest.split(".")[1]] = t
            else:
                raise ConversionError(f"HF tensor {name!r} has no megaloop mapping")
    for target, parts in pending.items():
        if target.endswith("linear_fc1.weight"):
            out[target] = torch.cat([parts["gate_proj"], parts["up_proj"]], dim=0)
        else:
            out[target] = _fuse_qkv(parts["q"], parts["k"], parts["v"], heads, groups, hd)
    return out


def hf_config_from_native(mcfg, *, vocab_size: int, tokenizer_vocab_size: int | None = None,
                          num_recurrences: int = 5, special: dict | None = None) -> MegaloopConfig:
    special = special or {}
    return MegaloopConfig(
        vocab_size=vocab_size, tokenizer_vocab_size=tokenizer_vocab_size or vocab_size,
        hidden_size=mcfg.hidden_size, num_attention_heads=mcfg.num_heads, num_key_value_heads=mcfg.groups,
        intermediate_size=mcfg.ffn_size, arch=mcfg.arch, n_prelude=mcfg.n_prelude, n_core=mcfg.n_core,
        n_coda=mcfg.n_coda, num_hidden_layers=mcfg.physical_layers, injection=mcfg.injection,
        exit_norm=mcfg.exit_norm, rms_norm_eps=mcfg.norm_eps, rope_theta=mcfg.rope_base,
        max_position_embeddings=mcfg.seq_len,
        state_init=mcfg.state_init, state_init_std=mcfg.state_init_std, eval_state_init=mcfg.eval_state_init,
        eval_seed=mcfg.eval_seed, num_recurrences=num_recurrences, initializer_range=mcfg.init_std_value,
        deq_std=mcfg.deq_std, tie_word_embeddings=mcfg.tie_embeddings,
        embedding_multiplier=mcfg.embedding_multiplier, qk_norm=mcfg.qk_norm, qk_norm_gain=mcfg.qk_norm_gain,
        qk_bias=mcfg.qk_bias,
        input_norm=mcfg.input_norm, sandwich_norm=mcfg.sandwich_norm, state_readout=mcfg.state_readout,
        state_final_norm=mcfg.state_final_norm,
        adapter_init=mcfg.adapter_init, adapter_bias=mcfg.adapter_bias,
        vocab_pad_multiple=mcfg.vocab_pad_multiple,  # for the way back (--from-hf): the native padding
        bos_token_id=special.get("bos"), eos_token_id=special.get("eos"), pad_token_id=special.get("pad"),
        architectures=["MegaloopForCausalLM"], auto_map=dict(AUTO_MAP))


def native_config_from_hf(cfg: MegaloopConfig):
    """``ModelConfig`` equivalent to an HF config (for HF → megaloop)."""
    from megaloop.model.config import ModelConfig

    vocab, multiple = _native_vocab(cfg)
    return ModelConfig(
        arch=cfg.arch, hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads if cfg.num_key_value_heads != cfg.num_attention_heads else None,
        ffn_hidden_size=cfg.intermediate_size, n_prelude=cfg.n_prelude, n_core=cfg.n_core, n_coda=cfg.n_coda,
        num_layers=cfg.num_hidden_layers, vocab_size=vocab,
        vocab_pad_multiple=multiple, seq_len=max(2, cfg.max_position_embeddings),
        injection=cfg.injection, exit_norm=bool(getattr(cfg, "exit_norm", True)),
        state_init=cfg.state_init, state_init_std=cfg.state_init_std,
        eval_state_init=cfg.eval_state_init, eval_seed=cfg.eval_seed, init_std=cfg.initializer_range,
        deq_std=cfg.deq_std, rope_base=cfg.rope_theta, tie_embeddings=cfg.tie_word_embeddings,
        norm_eps=cfg.rms_norm_eps, transformer_impl="local",
        embed_scale=float(getattr(cfg, "embedding_multiplier", 1.0)), qk_norm=bool(getattr(cfg, "qk_norm", False)),
        qk_norm_gain=bool(getattr(cfg, "qk_norm_gain", True)),
        input_norm=bool(getattr(cfg, "input_norm", False)), qk_bias=bool(getattr(cfg, "qk_bias", False)),
        sandwich_norm=bool(getattr(cfg, "sandwich_norm", False)),
        state_readout=bool(getattr(cfg, "state_readout", False)),
        state_final_norm=bool(getattr(cfg, "state_final_norm", False)),
        adapter_init=getattr(cfg, "adapter_init", "torch"), adapter_bias=bool(getattr(cfg, "adapter_bias", True)))


def _native_vocab(cfg: MegaloopConfig) -> tuple[int, int]:
    """``(model.vocab_size, model.vocab_pad_multiple)`` of an HF config: the tokenizer's own vocabulary
    (``tokenizer_vocab_size``, the ids generation may emit) padded to the HF embedding's rows (the round
    trip kept the padded size as the vocabulary, and generation then sampled ids no tokenizer has)."""
    padded = cfg.vocab_size
    real = int(getattr(cfg, "tokenizer_vocab_size", None) or padded)
    if real < padded:
        fits = [m for m in range(1, padded + 1) if padded % m == 0 and -(-real // m) * m == padded]
        recorded = getattr(cfg, "vocab_pad_multiple", None)  # exports of this release record it
        if isinstance(recorded, int) and recorded in fits:
            return real, recorded
        # an older export: the multiple with the most factors of two (the most TP degrees), then the
        # smallest; a multiple above 128 or not a power of two (e.g. 3000) fell back to the padded size
        return real, max(fits, key=lambda m: ((m & -m), -m))
    return padded, _pad_multiple(padded)


def _pad_multiple(v: int) -> int:
    for m in (128, 64, 32, 16, 8, 4, 2):
        if v % m == 0:
            return m
    return 1


# ============================================================================ tokenizer
def explicit_tokenizer(path: str | Path) -> Path:
    """``--tokenizer``: a tokenizer.json, or a folder holding one; else :class:`ConversionError` naming it."""
    p = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    if not p.is_file():
        raise ConversionError(f"--tokenizer {path}: no tokenizer.json there")
    if p.suffix != ".json":
        raise ConversionError(f"--tokenizer {path}: not a tokenizer.json (the Hugging Face tokenizers file)")
    return p


def run_dir_of(ckpt: Path) -> Path:
    """The run directory of a checkpoint: ``RUN`` of ``RUN/checkpoints/step_*``, else the folder
    holding the step (``convert --from-hf --out DIR`` keeps the tokenizer in ``DIR``)."""
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


def find_tokenizer(run_cfg: dict, ckpt: Path, explicit: str | Path | None = None) -> Path | None:
    """tokenizer.json of the run: ``explicit`` (``--tokenizer``) > the run's own copy (``RUN/tokenizer.json``;
    ``convert --from-hf`` keeps one there or in its ``--out``) > the one the training data's manifest names,
    only with the sha256 it records (and the fingerprint ``RUN/data.json`` records; a relative ``data.path``
    looked up from the run directory first) > the embedded set's (:func:`check_embedded_corpus`). A manifest
    tokenizer failing those checks, with nothing else found, is a ConversionError naming files and sha256s."""
    if explicit:
        return explicit_tokenizer(explicit)
    from megaloop.data.config import embedded_split
    from megaloop.data.tokenizer import find_relative, read_manifest, verified_manifest_tokenizer

    ckpt = Path(ckpt)
    run = run_dir_of(ckpt)
    for cand in dict.fromkeys((ckpt.parent / "tokenizer.json", run / "tokenizer.json",
                               run / "tokenizer" / "tokenizer.json")):
        if cand.is_file():
            return cand
    data = run_cfg.get("data") or {}
    path = str(data.get("path") or "")
    rejected: list[str] = []
    embedded = embedded_split(path, "train") is not None  # "default" / "default:NAME", not "default_data/"
    if path and "://" not in path and not embedded:
        recorded = (read_manifest(run, "data.json") or {}).get("manifest_fingerprint")

        def the_runs_data(folder: Path) -> bool:  # a dataset, and the one the run recorded (if it did)
            manifest = read_manifest(folder)
            if manifest is None or not recorded or manifest.get("fingerprint") == recorded:
                return manifest is not None
            rejected.append(f"{folder / 'manifest.json'} has fingerprint {str(manifest.get('fingerprint'))[:12]}…, "
                            f"the run trained on {recorded[:12]}… ({run / 'data.json'})")
            return False

        folder = find_relative(path, run, the_runs_data)
        if folder is not None:
            found, why = verified_manifest_tokenizer(folder)
            if found is not None:
                return found
            rejected += why
    if ckpt.parent.name != "checkpoints":  # a step folder's grandparent (layouts of earlier releases)
        for cand in (ckpt.parent.parent / "tokenizer.json", ckpt.parent.parent / "tokenizer" / "tokenizer.json"):
            if cand.is_file():
                return cand
    if embedded:
        from megaloop.data.default_corpus import ensure_default_tokenizer

        return check_embedded_corpus(run_cfg, ckpt, path) or Path(ensure_default_tokenizer(data.get("cache_dir")))
    if rejected:
        raise ConversionError(f"checkpoint {ckpt}: no tokenizer of the run: {run / 'tokenizer.json'} does not exist "
                              f"and the training data's is not the one it was trained with ({'; '.join(rejected)}); "
                              "pass --tokenizer with the run's tokenizer.json")
    return None


def _own_vocab(run_cfg: dict, ckpt: Path, explicit: str | Path | None, rows: int) -> int | None:
    """With a ``--tokenizer`` override, the vocabulary of the tokenizer the run trained with (None
    without an override, or when the run's is not found): the model's real vocabulary is the run's,
    so a smaller or larger override is told apart from it (it was measured on the override itself)."""
    if not explicit:
        return None
    try:
        own = find_tokenizer(run_cfg, ckpt, None)
    except ConversionError:
        return None
    if own is None or own.suffix != ".json":
        return None
    try:
        n = tokenizer_info(own)["vocab_size"]
    except Exception:  # an unreadable own tokenizer (perhaps why --tokenizer was given): not compared
        return None
    return n if n <= rows else None


# ============================================================================ in memory
def to_hf_model(native, mcfg, run_cfg: dict, ckpt: Path, *, num_recurrences: int | None = None,
                tokenizer: str | Path | None = None, log=None) -> tuple[MegaloopForCausalLM, Path | None]:
    """``(HF model, tokenizer.json or None)``: the model (CPU, FP32, eval mode; not validated, see
    :func:`check_conversion`) holds ``native``'s weights; its config's real vocabulary
    (``tokenizer_vocab_size``) and eos/bos/pad (also in the generation config) are those of the
    run's tokenizer (:func:`find_tokenizer`, ``tokenizer`` overriding it); its default depth
    (``num_recurrences``) is ``num_recurrences``, else the run's ``train.eval_depth``."""
    vocab = native.vocab_size
    depth = int(num_recurrences or (run_cfg.get("train") or {}).get("eval_depth") or 5)
    tok_path = find_tokenizer(run_cfg, ckpt, tokenizer)
    info: dict = {"vocab_size": None, "eos": None, "bos": None, "pad": None}
    if tok_path is not None and tok_path.suffix != ".json":
        if log:
            log(f"warning: tokenizer {tok_path} is not a tokenizer.json; not exported")
        tok_path = None
    if tok_path is not None:
        info = tokenizer_info(tok_path)
        if info["eos"] is not None:  # megaloop's documents are EOS-separated and no BOS is ever trained
            # (mds_convert): the export's BOS is the EOS token (GPT-2's convention), so lm-eval's HF
            # model (its prefix token is the BOS) and HF generate condition as training and `eval harness` do
            info["bos"] = info["eos"]
        if info["vocab_size"] > vocab and tokenizer:  # the user's --tokenizer: named as theirs
            from megaloop.config_utils import ConfigError

            raise ConfigError(f"--tokenizer {tokenizer}: its vocabulary ({info['vocab_size']} tokens) is larger than "
                              f"the model's ({vocab}), so it is not the tokenizer the model was trained with")
        if info["vocab_size"] > vocab:
            raise ConversionError(f"tokenizer {tok_path} has {info['vocab_size']} tokens but the checkpoint's "
                                  f"embedding has only {vocab} rows: wrong tokenizer (pass --tokenizer)")
    real_vocab = mcfg.vocab_size or _own_vocab(run_cfg, ckpt, tokenizer, vocab) or info["vocab_size"] or vocab
    if real_vocab > vocab:
        raise ConversionError(f"model.vocab_size {real_vocab} exceeds the checkpoint's {vocab} embedding rows")
    cfg = hf_config_from_native(mcfg, vocab_size=vocab, tokenizer_vocab_size=real_vocab, num_recurrences=depth,
                                special={k: info[k] for k in ("eos", "bos", "pad")})
    with torch.device("meta"):  # no random init: every tensor comes from the native model
        model = MegaloopForCausalLM(cfg)
    # the native model sits on this machine's compute device; the HF model is built on the CPU
    sd = {k: v.float().cpu() for k, v in native_to_hf_state_dict(native.state_dict(), mcfg).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise ConversionError(f"checkpoint {ckpt}: weight mapping mismatch: missing {missing}, "
                              f"unexpected {unexpected}")
    model.tie_weights()
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id = info["bos"], info["eos"]
    gen.pad_token_id = info["pad"] if info["pad"] is not None else info["eos"]
    if real_vocab < vocab:
        gen.suppress_tokens = list(range(real_vocab, vocab))  # padded rows never name a token
    return model.eval(), tok_path


# what an export writes (its report lists them; an export written before the list: these names)
_EXPORT_NAMES = frozenset({*CODE_FILES, "config.json", "generation_config.json", "model.safetensors",
                           "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                           "special_tokens_map.json", "chat_template.jinja", "megaloop_conversion.json",
                           "__pycache__"})


def foreign_entries(export: Path) -> list[str]:
    """Names in the earlier export ``export`` that no export writes (a model card, notes, a checkpoint
    converted back into it): replacing the export would delete them, so they are named instead."""
    try:
        listed = json.loads((export / "megaloop_conversion.json").read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        listed = None
    own = set(listed) | {"__pycache__"} if isinstance(listed, list) else _EXPORT_NAMES
    legacy = ("model-", ".safetensors"), ("", "_megaloop.py")  # weight shards; code files of earlier releases
    return sorted(p.name for p in export.iterdir() if p.name not in own
                  and not (listed is None and any(p.name.startswith(a) and p.name.endswith(z) for a, z in legacy)))


# ============================================================================ main entry
def convert_to_hf(checkpoint: str | Path, out: str | Path, *, dtype: str = "fp32", validate: bool = True,
                  tokenizer: str | Path | None = None, num_recurrences: int | None = None,
                  max_shard_size: int | str = "2GB", validation_seqs: int = 2, validation_len: int | None = None,
                  log=print) -> dict:
    """Convert ``checkpoint`` to an HF folder ``out``; returns a report dict (also written to
    ``out/megaloop_conversion.json``). It is written beside ``out`` and renamed into place when
    complete, replacing an earlier export only then (one holding nothing an export does not write,
    :func:`foreign_entries`): a failure leaves ``out`` as it was. Raises
    :class:`CheckpointError` for a bad checkpoint, :class:`ConversionError` for a bad conversion,
    ``tokenizer`` or when validation exceeds :data:`TOLERANCE`."""
    t0 = time.time()
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype}: one of {sorted(DTYPES)}")
    tokenizer = explicit_tokenizer(tokenizer) if tokenizer else None
    out = Path(os.path.abspath(out))
    native, mcfg, run_cfg, ckpt, common = load_newest(checkpoint, load_native)  # a training run may prune it
    hf_model, tok_path = to_hf_model(native, mcfg, run_cfg, ckpt, num_recurrences=num_recurrences,
                                     tokenizer=tokenizer, log=log)
    cfg = hf_model.config
    depth, real_vocab = cfg.num_recurrences, cfg.tokenizer_vocab_size
    if tok_path is None:
        log("warning: no tokenizer found (data manifest / run dir / --tokenizer); exporting the model only")
    report: dict[str, Any] = {"checkpoint": str(ckpt), "step": common.get("step"), "dtype": dtype,
                              "num_recurrences": depth, "vocab_size": native.vocab_size,
                              "tokenizer_vocab_size": real_vocab, "tokenizer": str(tok_path) if tok_path else None,
                              "tolerance": TOLERANCE}
    if validate:
        report["validation"] = check_conversion(native, hf_model, seq_len=validation_len or min(mcfg.seq_len, 64),
                                                num_seqs=validation_seqs)
        log(report["validation"]["summary"])
    del native
    sweep_stale(out, log)
    staging = staging_dir(out)
    tmp = staging / out.name  # out's base name: the reload check imports the code as `out` will
    try:
        try:
            tmp.mkdir(parents=True)
        except OSError as err:  # the CLI probes --out's folder first; an API caller learns it here
            raise ConversionError(f"--out {out}: the export cannot be staged beside it ({staging}: "
                                  f"{err.strerror or err}); nothing was written") from None
        hf_model.to(DTYPES[dtype])
        hf_model.config.dtype = DTYPES[dtype]  # `torch_dtype` is deprecated since transformers 4.56
        hf_model.save_pretrained(str(tmp), max_shard_size=max_shard_size, safe_serialization=True)
        plain_mode(*tmp.glob("*.safetensors"))  # safetensors writes 0600; the folder's other files follow the umask
        for name in CODE_FILES:
            shutil.copyfile(HF_DIR / name, tmp / name)
        if tok_path is not None:
            save_tokenizer(tok_path, tmp, {"eos": cfg.eos_token_id, "bos": cfg.bos_token_id,
                                           "pad": cfg.pad_token_id}, mcfg.seq_len)
        if validate:
            report["reload"] = check_reload(hf_model, tmp, depth, real_vocab)
            log(f"reload check ({dtype} weights from {out}): max abs diff {report['reload']['max_abs']:.3e}")
        report["seconds"] = round(time.time() - t0, 2)
        report["files"] = sorted([p.name for p in tmp.iterdir()] + ["megaloop_conversion.json"])
        (tmp / "megaloop_conversion.json").write_text(json.dumps(report, indent=1, default=str))
        if (out / "megaloop_conversion.json").is_file():  # an earlier export, replaced only now
            foreign = foreign_entries(out)
            if foreign:
                raise ConversionError(f"--out {out} holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}"
                                      ", which the earlier export there did not write: replacing it would delete "
                                      "them; move them or choose another --out; nothing was written")
            out.rename(staging / f"{out.name}.old")
        tmp.rename(out)  # onto nothing or an empty folder (the CLI refuses any other --out up front)
    finally:
        put_back(out, staging, log)  # stopped between moving the earlier export aside and the rename
        shutil.rmtree(staging, ignore_errors=True)
    return report
