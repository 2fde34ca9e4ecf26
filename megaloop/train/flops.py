"""Model-FLOP accounting (SPEC §6). Units: FLOPs (multiply-add = 2 FLOPs).

Per microbatch at depth r with window b = min(r, bptt_window): forward = prelude + r·core + coda +
head; backward ≈ 2 × forward of prelude + b·core + coda + head. Each logical update is counted
once; activation recomputation and the depth-prior controller are excluded. Attention scores are
counted over the full s×s square (as Megatron-LM does), so MFU is comparable across codebases.
"""

from __future__ import annotations

from megaloop.model.config import ModelConfig


def layer_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs of one transformer layer per token."""
    d, f = cfg.hidden_size, cfg.ffn_size
    kv = d * cfg.groups // cfg.num_heads
    qkv_proj = 2 * d * (d + 2 * kv) + 2 * d * d
    mlp = 2 * 3 * d * f  # SwiGLU: gate, up, down
    attn = 2 * 2 * seq_len * d  # QKᵀ and AV
    return float(qkv_proj + mlp + attn)


def injection_flops_per_token(cfg: ModelConfig) -> float:
    """Forward FLOPs per token and recurrence of the injection (excluding once-per-pass work)."""
    d = cfg.hidden_size
    if cfg.injection == "huginn_linear":
        return 2.0 * 2 * d * d
    if cfg.injection == "deq_qkv":
        kv = d * cfg.groups // cfg.num_heads
        return 2.0 * d * (d + 2 * kv) * cfg.n_core
    return 4.0 * d  # diagonal: elementwise (+ projection for orthoinj)


def forward_flops_per_token(cfg: ModelConfig, vocab: int, seq_len: int, depth: int) -> tuple[float, float, float]:
    """(outside-loop, per-recurrence, head) forward FLOPs per token."""
    layer = layer_flops_per_token(cfg, seq_len)
    head = 2.0 * cfg.hidden_size * vocab
    if not cfg.looped:
        return cfg.num_layers * layer, 0.0, head
    once = (cfg.n_prelude + cfg.n_coda) * layer
    if cfg.injection in ("parcae_decay", "parcae_nonorm", "orthoinj", "orthoinj_early"):
        once += 2.0 * cfg.hidden_size * cfg.hidden_size  # q = Δ ⊙ W ẽ, once per pass
    if cfg.state_readout:
        once += 2.0 * cfg.hidden_size * cfg.hidden_size  # C h^R, once per pass
    return once, cfg.n_core * layer + injection_flops_per_token(cfg), head


def microbatch_flops(cfg: ModelConfig, vocab: int, seq_len: int, tokens: int, depth: int, bptt_window: int,
                     forward_only: bool = False) -> float:
    """Model FLOPs of one microbatch of ``tokens`` tokens at depth ``depth``."""
    once, per_rec, head = forward_flops_per_token(cfg, vocab, seq_len, depth)
    r = depth if cfg.looped else 0
    fwd = once + r * per_rec + head
    if forward_only:
        return tokens * fwd
    b = min(r, bptt_window)
    bwd = 2.0 * (once + b * per_rec + head)
    return tokens * (fwd + bwd)


# dense bf16 peaks (NVIDIA data sheets: half the sparse figures), the more specific names first:
# "NVIDIA H100 PCIe" and "NVIDIA H100 NVL" are slower parts than the SXM "NVIDIA H100 80GB HBM3"
DEVICE_PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H200 NVL": 835.0, "H200": 989.0, "H100": 989.0,
                      "A100": 312.0}


def device_peak_tflops(configured: float) -> float:
    """The configured peak, else a known dense-bf16 peak for the GPU, else 0 (MFU not reported)."""
    if configured > 0:
        return configured
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, val in DEVICE_PEAK_TFLOPS.items():
            if key in name:
                return val
    return 0.0
