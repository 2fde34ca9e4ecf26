"""Forward-pass equivalence of a reference-matched megaloop model and a reference implementation.

``parity.py --check-forward RUN --system parcae|huginn --ref-path PATH`` loads a megaloop model
(a harness run directory, a training run or an HF export; :func:`megaloop.hf.load.load_model`),
builds the reference at the same shape, copies megaloop's weights into it and compares the logits
of both at each depth R from h⁰ = 0 on validation sequences. Agreement to float32 round-off says
the matched config computes the reference's function (what is left between the two training runs
is then optimisation and initialisation); a disagreement names the part of the model that differs.

Weight layout. megaloop's exported model keeps q, k, v, gate and up as separate matrices and uses
rotate-half RoPE (pairs (j, j + hd/2)); both references fuse some of them and use interleaved RoPE
(pairs (2j, 2j+1)) with the same frequencies, so q and k rows (and Huginn's per-head QK biases) are
permuted within each head by :func:`rope_permutation`; attention scores are unchanged by a common
permutation of q and k. What cannot be represented is refused before any copy
(:func:`transfer_problems`), naming the config field.
"""

from __future__ import annotations

import math

import torch


def rope_permutation(head_dim: int) -> torch.Tensor:
    """Index p with ``interleaved = rotate_half_layout[..., p]``: interleaved pair (2j, 2j+1) holds
    the rotate-half pair (j, j + hd/2), which RoPE rotates by the same angle."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    half = head_dim // 2
    p = torch.empty(head_dim, dtype=torch.long)
    p[0::2] = torch.arange(half)
    p[1::2] = torch.arange(half) + half
    return p


def permute_heads(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Rows of a [heads·hd, …] projection (or a [heads, hd] bias) in the interleaved RoPE layout."""
    p = rope_permutation(head_dim)
    return w.reshape(heads, head_dim, -1)[:, p].reshape(w.shape)


def transfer_problems(config, system: str) -> list[str]:
    """Fields of a megaloop HF config that the reference ``system`` cannot represent (empty: OK)."""
    c = config
    need: dict[str, tuple[object, object]] = {}
    get = lambda name, default=None: getattr(c, name, default)  # noqa: E731
    common = {"tie_word_embeddings": (get("tie_word_embeddings"), True),
              "num_key_value_heads": (get("num_key_value_heads") or c.num_attention_heads, c.num_attention_heads)}
    if system == "parcae":
        need = {"injection": (c.injection, "parcae_decay"), "state_readout": (get("state_readout", False), True),
                "qk_norm": (get("qk_norm", False), True), "qk_bias": (get("qk_bias", False), False),
                "sandwich_norm": (get("sandwich_norm", False), False),
                "input_norm": (get("input_norm", False), False)}
    elif system == "huginn":
        need = {"injection": (c.injection, "huginn_linear"), "sandwich_norm": (get("sandwich_norm", False), True),
                "exit_norm": (get("exit_norm", True), False), "input_norm": (get("input_norm", False), False),
                "adapter_bias": (get("adapter_bias", True), False),
                "qk_norm": (get("qk_norm", False), False), "state_readout": (get("state_readout", False), False)}
    else:
        raise ValueError(f"unknown reference {system!r}")
    need.update(common)
    return [f"{k}={have!r} (the {system} reference needs {want!r})" for k, (have, want) in need.items()
            if have != want]


def require_transferable(config, system: str) -> None:
    """Refuse, naming every field, a megaloop config the reference ``system`` cannot express."""
    problems = transfer_problems(config, system)
    if problems:
        raise SystemExit(f"--check-forward: the megaloop model cannot be expressed as the {system} "
                         "reference: " + "; ".join(problems))


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise SystemExit(f"--check-forward: {name}: reference shape {tuple(dst.shape)} vs megaloop "
                         f"{tuple(src.shape)}")
    dst.copy_(src.to(dst.dtype))


@torch.no_grad()
def _block(dst, src, heads: int, head_dim: int, name: str, system: str) -> None:
    a = src.self_attn
    q = permute_heads(a.q_proj.weight, heads, head_dim)
    k = permute_heads(a.k_proj.weight, heads, head_dim)
    _copy(dst.norm_1.weight, src.input_layernorm.weight, f"{name}.norm_1")
    if system == "parcae":
        for g in (a.q_norm.weight, a.k_norm.weight):
            if not torch.all(g == 1):
                raise SystemExit(f"--check-forward: {name}: QK-norm gains are not 1 (qk_norm_gain=true); "
                                 "Parcae's QK-norm has no gains (F.rms_norm), so its RoPE-then-norm order "
                                 "differs only when the gains are 1")
        _copy(dst.attn.c_q.weight, q, f"{name}.attn.c_q")
        _copy(dst.attn.c_k.weight, k, f"{name}.attn.c_k")
        _copy(dst.attn.c_v.weight, a.v_proj.weight, f"{name}.attn.c_v")
        _copy(dst.attn.c_proj.weight, a.o_proj.weight, f"{name}.attn.c_proj")
        _copy(dst.norm_2.weight, src.post_attention_layernorm.weight, f"{name}.norm_2")
    else:  # huginn: fused Wqkv, per-head QK biases, sandwich norms 2 and 4
        _copy(dst.attn.Wqkv.weight, torch.cat([q, k, a.v_proj.weight]), f"{name}.attn.Wqkv")
        dst.attn.qk_bias.zero_()  # Huginn's config has QK biases; zero = megaloop without them
        if getattr(a, "q_bias", None) is not None:
            dst.attn.qk_bias[0, 0].copy_(permute_heads(a.q_bias, heads, head_dim))
            dst.attn.qk_bias[1, 0].copy_(permute_heads(a.k_bias, heads, head_dim))
        _copy(dst.attn.proj.weight, a.o_proj.weight, f"{name}.attn.proj")
        _copy(dst.norm_2.weight, src.post_attn_norm.weight, f"{name}.norm_2")
        _copy(dst.norm_3.weight, src.post_attention_layernorm.weight, f"{name}.norm_3")
        _copy(dst.norm_4.weight, src.post_mlp_norm.weight, f"{name}.norm_4")
    m = src.mlp  # both references: fc = [gate; up], act(fc_1) * fc_2
    _copy(dst.mlp.fc.weight, torch.cat([m.gate_proj.weight, m.up_proj.weight]), f"{name}.mlp.fc")
    _copy(dst.mlp.proj.weight, m.down_proj.weight, f"{name}.mlp.proj")


@torch.no_grad()
def transfer(hf, ref) -> None:
    """Copy the megaloop HF model ``hf``'s weights into reference adapter ``ref`` (in place)."""
    require_transferable(hf.config, ref.name)
    c, m, t = hf.config, hf.model, ref.model.transformer
    heads = c.num_attention_heads
    hd = c.hidden_size // heads
    mult = float(getattr(c, "embedding_multiplier", 1.0))
    if not math.isclose(mult, float(ref.model.emb_scale), rel_tol=1e-6):
        raise SystemExit(f"--check-forward: embedding_multiplier={mult} but the {ref.name} reference scales "
                         f"embeddings by {ref.model.emb_scale}")
    _copy(t.wte.weight, m.embed_tokens.weight, "wte")
    _copy(ref.model.lm_head.weight, hf.lm_head.weight, "lm_head")  # the same values again where tied
    for group, dst_group in (("prelude", "prelude"), ("core", "core_block"), ("coda", "coda")):
        src, dst = getattr(m, group), getattr(t, dst_group)
        if len(src) != len(dst):
            raise SystemExit(f"--check-forward: {group}: {len(src)} megaloop layers vs {len(dst)} in the reference")
        for i, (s, d) in enumerate(zip(src, dst)):
            _block(d, s, heads, hd, f"{group}.{i}", ref.name)
    inj = m.injection
    if ref.name == "parcae":
        _copy(t.adapter.dt_bias, inj.delta_raw, "adapter.dt_bias")
        _copy(t.adapter.A_log, inj.alpha_log, "adapter.A_log")
        _copy(t.adapter.B, inj.proj, "adapter.B")
        _copy(t.ln_prelude.weight, inj.norm_weight, "ln_prelude")
        _copy(t.C.weight, m.state_readout.weight, "C")
    else:
        _copy(t.adapter.weight, inj.adapter.weight, "adapter")  # both bias-free (adapter_bias=False)
    _copy(t.ln_f.weight, m.norm.weight, "ln_f")


@torch.no_grad()
def compare(hf, ref, tokens: torch.Tensor, depths: list[int]) -> dict:
    """Logits of both models from h⁰ = 0 at each depth (tokens [b, s]): max and RMS |Δ| and the
    logits' RMS; for Huginn also with its pre-coda ``ln_f`` on the state skipped (``no_state_norm``).
    A control re-runs R = max(depths) with one reference tensor scaled by 1.01 (the check can fail)."""
    hf.eval()
    init, ref_init = hf.config.eval_state_init, ref.cfg.state_init
    hf.config.eval_state_init, ref.cfg.state_init = "zero", "zero"
    rows, ours = [], {}
    try:
        for r in depths:
            a = ours[r] = hf(input_ids=tokens, num_recurrences=r).logits.float()
            b = ref.logits(tokens, r).float()
            row = {"R": r, "logits_rms": float(a.pow(2).mean().sqrt()), "max_abs_diff": float((a - b).abs().max()),
                   "rms_diff": float((a - b).pow(2).mean().sqrt())}
            if ref.name == "huginn":
                c = ref.logits(tokens, r, state_norm=False).float()
                row["no_state_norm_max_abs_diff"] = float((a - c).abs().max())
            rows.append(row)
        w = ref.model.transformer.core_block[-1].mlp.proj.weight
        w.mul_(1.01)
        r = max(depths)
        a = ours[r]  # megaloop's side is unchanged by the perturbation
        own = bool(getattr(hf.config, "state_final_norm", False))  # the comparison that should agree
        b = ref.logits(tokens, r, **({"state_norm": own} if ref.name == "huginn" else {})).float()
        w.div_(1.01)
        control = {"R": r, "perturbed": "core_block[-1].mlp.proj x 1.01", "max_abs_diff": float((a - b).abs().max())}
    finally:
        hf.config.eval_state_init, ref.cfg.state_init = init, ref_init
    return {"rows": rows, "control": control, "tokens_shape": list(tokens.shape)}
