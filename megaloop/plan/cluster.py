"""Cluster descriptions: node shape, GPU memory, peak FLOP/s, link bandwidths, and the cost
model's efficiency assumptions. Shipped as editable YAML in ``megaloop/plan/clusters/``.

``load_cluster("h100", ["cluster.gpu_memory_gib=94"])`` reads a shipped description (or a YAML
path) and applies ``cluster.KEY=VALUE`` overrides; errors are ConfigError naming the field.
Units: GiB, TFLOP/s (dense), GB/s per GPU per direction, microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megaloop.config_utils import ConfigError, apply_dotlist, from_dict, load_yaml, require, to_dict

CLUSTER_DIR = Path(__file__).parent / "clusters"
PROFILES = ("te", "local")


@dataclass
class ClusterSpec:
    """One node type. Fields after ``hbm_gbps`` are assumptions of the cost model (not measured
    here); ``tools/gpu_check.sh`` records what calibrates them."""

    name: str = "custom"
    gpu: str = "unknown"
    gpus_per_node: int = 8
    nodes: int = 1  # default node count when no --gpus/--nodes is given
    gpu_memory_gib: float = 80.0  # as torch.cuda.get_device_properties reports
    peak_bf16_tflops: float = 989.0  # dense
    peak_fp8_tflops: float = 1979.0  # dense
    intra_node_gbps: float = 450.0  # NVLink, per GPU per direction
    inter_node_gbps: float = 50.0  # network, per GPU per direction
    hbm_gbps: float = 3350.0
    # --- assumptions (calibrate with a GPU run: tools/gpu_check.sh records step time and memory)
    gemm_efficiency: float = 0.6  # achieved share of peak for a layer's matmuls and attention
    comm_efficiency: float = 0.7  # achieved share of link bandwidth in collectives / p2p
    p2p_latency_us: float = 15.0
    collective_latency_us: float = 25.0
    layer_overhead_us: float = 20.0  # per layer visit and pass: kernel launches, small ops
    reserved_gib: float = 4.0  # CUDA context, NCCL buffers, cuBLAS/TE workspaces
    fragmentation: float = 1.10  # caching-allocator overhead on activations and transients
    activation_profile: str = "te"  # te: Transformer Engine layers (GPU); local: megatron local spec (CPU)
    optimizer_temp_bytes: float = 0.0  # transient bytes per optimizer-owned parameter (fused Adam: 0)

    def __post_init__(self) -> None:
        for f in ("gpus_per_node", "nodes"):
            require(getattr(self, f) >= 1, f"cluster.{f}", f"must be >= 1, got {getattr(self, f)}")
        for f in ("gpu_memory_gib", "peak_bf16_tflops", "peak_fp8_tflops", "intra_node_gbps",
                  "inter_node_gbps", "hbm_gbps", "gemm_efficiency", "comm_efficiency", "fragmentation"):
            require(getattr(self, f) > 0, f"cluster.{f}", f"must be > 0, got {getattr(self, f)}")
        for f in ("p2p_latency_us", "collective_latency_us", "layer_overhead_us", "reserved_gib", "optimizer_temp_bytes"):
            require(getattr(self, f) >= 0, f"cluster.{f}", f"must be >= 0, got {getattr(self, f)}")
        require(self.gemm_efficiency <= 1 and self.comm_efficiency <= 1, "cluster.gemm_efficiency",
                "efficiencies must lie in (0, 1]")
        require(self.activation_profile in PROFILES, "cluster.activation_profile", f"one of {PROFILES}")

    def to_dict(self) -> dict:
        return to_dict(self)


def shipped_clusters() -> list[str]:
    return sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml"))


def load_cluster(name_or_path: str, overrides: list[str] | None = None) -> ClusterSpec:
    """Shipped name (``h100``, ``h200``, ``b200``; case-insensitive) or a YAML path, then
    ``cluster.KEY=VALUE`` (or ``KEY=VALUE``) overrides."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        data = load_yaml(p)
    else:
        q = CLUSTER_DIR / f"{name_or_path.lower()}.yaml"
        if not q.is_file():
            raise ConfigError(f"cluster: unknown GPU/cluster {name_or_path!r} (shipped: "
                              f"{', '.join(shipped_clusters())}; or a YAML path)")
        data = load_yaml(q)
    items = [o.split(".", 1)[1] if o.startswith("cluster.") else o for o in overrides or []]
    apply_dotlist(data, items)
    return from_dict(ClusterSpec, data, prefix="cluster")
