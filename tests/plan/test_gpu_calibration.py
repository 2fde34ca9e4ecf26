"""tools/gpu/plan_calibration.py (what tools/gpu_check.sh records for the planner) on a fake GPU-check
output directory: the planner's predictions beside the measured step time and memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from megaloop.config import load_config
from tests.conftest import ROOT


def test_plan_calibration_records_predictions(tmp_path: Path) -> None:
    run = tmp_path / "train_bf16"
    run.mkdir()
    load_config("S", ["train.global_batch_size=32", "train.micro_batch_size=4"]).dump(run / "config.yaml")
    (tmp_path / "device.json").write_text(json.dumps({"device": "NVIDIA H200", "cuda_available": True,
                                                      "device_mem_gib": 139.8}))
    rows = [{"step": i + 1, "depths": [5, 3, 9, 4, 6, 2, 5, 7], "step_time_s": 0.9, "mfu": 0.3, "peak_mem_gib": 30.0}
            for i in range(6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu" / "plan_calibration.py"), str(tmp_path),
                           "--runs", "bf16", "--warmup", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads((tmp_path / "plan_calibration.json").read_text())
    assert out["cluster_description"] == "h200" and out["comparable"] is True
    r = out["runs"]["bf16"]
    assert r["steps"] == 4 and r["layout"] == "TP1 PP1 DP1 mbs4" and r["measured_step_s"] == 0.9
    assert 0 < r["predicted_step_s"] < 10 and 0 < r["predicted_peak_allocated_gib"] < 139.8
    assert r["memory_error"] == r["predicted_peak_allocated_gib"] / 30.0 - 1
    assert r["implied_gemm_efficiency"] == out["assumptions"]["gemm_efficiency"] * r["predicted_step_s"] / 0.9


def test_a_slower_part_of_a_shipped_gpu_is_planned_at_its_own_peak() -> None:
    """`plan --cluster auto` and the calibration took the SXM H100's 989 TFLOP/s for an "H100 PCIe" (756), so
    the implied GEMM efficiency a user copies into a cluster YAML was off by 1.31x; the trainer's MFU already
    used the part's peak."""
    from megaloop.plan.cluster import device_cluster

    sxm, base = device_cluster("NVIDIA H100 80GB HBM3")
    assert base == "h100" and (sxm.peak_bf16_tflops, sxm.peak_fp8_tflops) == (989.0, 1979.0)
    pcie, base = device_cluster("NVIDIA H100 PCIe")
    assert base == "h100" and (pcie.peak_bf16_tflops, pcie.peak_fp8_tflops) == (756.0, 1512.0)
    nvl, base = device_cluster("NVIDIA H200 NVL", ["gpu_memory_gib=139.8"])
    assert base == "h200" and nvl.peak_bf16_tflops == 835.0 and nvl.gpu_memory_gib == 139.8
    assert device_cluster("NVIDIA H100 PCIe", ["peak_bf16_tflops=700"])[0].peak_bf16_tflops == 700.0  # overrides win
    assert device_cluster("NVIDIA GeForce RTX 4090")[1] == "h100"  # unknown parts: the h100 description, as before
    a100 = device_cluster("NVIDIA A100-SXM4-80GB")[0]
    assert a100.peak_bf16_tflops == 312.0 and a100.peak_fp8_tflops is None  # no FP8 on Ampere
