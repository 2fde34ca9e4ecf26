"""Cluster descriptions: node shape, GPU memory, peak FLOP/s, link bandwidths, and the cost
model's efficiency assumptions. Shipped as editable YAML in ``megaloop/plan/clusters/``.

``load_cluster("h100", ["cluster.gpu_memory_gib=94"])`` reads a shipped description (or a YAML
path) and applies ``cluster.KEY=VALUE`` overrides; errors are ConfigError naming the field (and
``--cluster`` for the file itself). Units: GiB, TFLOP/s (dense), GB/s per GPU per direction,
microseconds.

A YAML of one's own must give the hardware (:data:`HARDWARE`: GPU name, GPUs per node, memory,
dense bf16 and FP8 peaks, link and HBM bandwidths; ``peak_fp8_tflops: null`` for a GPU without
FP8), directly, through ``base: other.yaml`` or as ``cluster.KEY=VALUE``; a missing one is an
error, not a silent H100 default. The cost model's assumptions (efficiencies, latencies,
overheads, reserve, fragmentation, profile) and ``name`` / ``nodes`` may be left out: they take
the shipped values, and :attr:`ClusterSpec.defaulted` lists which did (the report prints them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from megaloop.config_utils import ConfigError, apply_dotlist, from_dict, load_yaml, require, to_dict

CLUSTER_DIR = Path(__file__).parent / "clusters"
PROFILES = ("te", "local")
# fields a cluster YAML must give: what the hardware is (no sensible default across GPUs)
HARDWARE = ("gpu", "gpus_per_node", "gpu_memory_gib", "peak_bf16_tflops", "peak_fp8_tflops", "intra_node_gbps",
            "inter_node_gbps", "hbm_gbps")
FRAGMENTATION_RANGE = (1.0, 2.0)  # a multiplier on dynamic bytes: 1 = no allocator overhead


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
    peak_fp8_tflops: float | None = 1979.0  # dense; None (YAML null) = the GPU has no FP8
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
    # fields the description left out that took the defaults above (filled by load_cluster)
    defaulted: tuple = field(default=(), init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        for f in ("gpus_per_node", "nodes"):
            require(getattr(self, f) >= 1, f"cluster.{f}", f"must be >= 1, got {getattr(self, f)}")
        for f in ("gpu_memory_gib", "peak_bf16_tflops", "intra_node_gbps",
                  "inter_node_gbps", "hbm_gbps", "gemm_efficiency", "comm_efficiency"):
            require(getattr(self, f) > 0, f"cluster.{f}", f"must be > 0, got {getattr(self, f)}")
        for f in ("p2p_latency_us", "collective_latency_us", "layer_overhead_us", "reserved_gib", "optimizer_temp_bytes"):
            require(getattr(self, f) >= 0, f"cluster.{f}", f"must be >= 0, got {getattr(self, f)}")
        if self.peak_fp8_tflops is not None:  # dense FP8 runs the same GEMMs at least as fast as bf16
            require(self.peak_fp8_tflops >= self.peak_bf16_tflops, "cluster.peak_fp8_tflops",
                    f"{self.peak_fp8_tflops:g} is below cluster.peak_bf16_tflops={self.peak_bf16_tflops:g} "
                    "(the dense FP8 peak is at least the bf16 one; null for a GPU without FP8)")
        require(self.gemm_efficiency <= 1, "cluster.gemm_efficiency", "must lie in (0, 1]")
        require(self.comm_efficiency <= 1, "cluster.comm_efficiency", "must lie in (0, 1]")
        lo, hi = FRAGMENTATION_RANGE
        require(lo <= self.fragmentation <= hi, "cluster.fragmentation",
                f"must lie in [{lo:g}, {hi:g}] (a multiplier on activations and transients: 1 = none; "
                f"PyTorch's caching allocator typically needs 1.0-1.3), got {self.fragmentation:g}")
        require(self.reserved_gib < self.gpu_memory_gib, "cluster.reserved_gib",
                f"{self.reserved_gib:g} GiB leaves nothing of cluster.gpu_memory_gib={self.gpu_memory_gib:g}")
        require(self.activation_profile in PROFILES, "cluster.activation_profile", f"one of {PROFILES}")

    def peak_tflops(self, fp8: bool) -> float:
        """Dense peak of the precision the GEMMs run in (ConfigError when FP8 has none here)."""
        if not fp8:
            return self.peak_bf16_tflops
        if self.peak_fp8_tflops is None:
            raise ConfigError(f"model.fp8: cluster {self.name} ({self.gpu}) has no FP8 peak "
                              "(cluster.peak_fp8_tflops: null); plan without FP8 or set it")
        return self.peak_fp8_tflops

    def to_dict(self) -> dict:
        out = to_dict(self)
        out.pop("defaulted", None)
        return out


def shipped_clusters() -> list[str]:
    return sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml"))


def device_cluster(gpu_name: str, overrides: list[str] | None = None) -> tuple[ClusterSpec, str]:
    """The shipped description for a GPU named as ``torch.cuda.get_device_name`` says (``h100`` when
    none matches) and its name; the dense peaks are the named part's (``train.flops.DEVICE_PEAK_TFLOPS``:
    an "H100 PCIe" is planned at 756 TFLOP/s bf16, not the SXM's 989; FP8 twice that), before
    ``overrides``. Bandwidths stay the shipped node's (SXM/HGX)."""
    from megaloop.train.flops import DEVICE_PEAK_TFLOPS

    base = next((c for c in shipped_clusters() if c.upper() in gpu_name.upper()), "h100")
    peak = next((v for k, v in DEVICE_PEAK_TFLOPS.items() if k.upper() in gpu_name.upper()), None)
    spec = load_cluster(base)
    no_fp8 = "A100" in gpu_name.upper()  # Ampere has no FP8 tensor cores
    part = [] if peak is None or peak == spec.peak_bf16_tflops else \
        [f"peak_bf16_tflops={peak}"] + (["peak_fp8_tflops=null"] if no_fp8 else
                                         [f"peak_fp8_tflops={2 * peak}"] if spec.peak_fp8_tflops else [])
    return load_cluster(base, [*part, *(overrides or [])]), base


def load_cluster(name_or_path: str, overrides: list[str] | None = None) -> ClusterSpec:
    """Shipped name (``h100``, ``h200``, ``b200``; case-insensitive) or a YAML path, then
    ``cluster.KEY=VALUE`` (or ``KEY=VALUE``) overrides. Errors about the file name ``--cluster``;
    a description without one of the :data:`HARDWARE` fields is an error."""
    if not name_or_path.strip():
        raise ConfigError(f"--cluster: empty; give one of {', '.join(shipped_clusters())}, auto, or a YAML path")
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists() or "/" in name_or_path:
        if p.is_dir():
            raise ConfigError(f"--cluster: {p} is a directory, not a cluster YAML file")
        if not p.is_file():
            raise ConfigError(f"--cluster: file {p} does not exist (shipped descriptions: "
                              f"{', '.join(shipped_clusters())}; or a YAML path)")
        try:
            data = load_yaml(p)
        except ConfigError as err:
            raise ConfigError(f"--cluster: {err}") from None
        where = f"--cluster {p}"
    else:
        q = CLUSTER_DIR / f"{name_or_path.lower()}.yaml"
        if not q.is_file():
            raise ConfigError(f"cluster: unknown GPU/cluster {name_or_path!r} (shipped: "
                              f"{', '.join(shipped_clusters())}; or a YAML path)")
        data = load_yaml(q)
        where = f"cluster {name_or_path}"
    items = [o.split(".", 1)[1] if o.startswith("cluster.") else o for o in overrides or []]
    apply_dotlist(data, items)
    missing = [f for f in HARDWARE if f not in data]
    if missing:
        raise ConfigError(f"{where}: missing hardware field(s) {', '.join(missing)} (no default: give them in the "
                          f"file or as cluster.KEY=VALUE; see megaloop/plan/clusters/h100.yaml)")
    if "name" not in data:
        data["name"] = p.stem if where.startswith("--cluster") else name_or_path.lower()
    spec = from_dict(ClusterSpec, data, prefix="cluster")
    spec.defaulted = tuple(f.name for f in dataclasses.fields(ClusterSpec)
                           if f.name not in data and f.name not in ("name", "defaulted"))
    return spec
