"""What the planner (megaloop/plan) needs from a GPU run: its predictions next to what the GPU check's
training runs measured, per step (same config, layout and drawn depths).

    python tools/gpu/plan_calibration.py OUT [--runs bf16 fp8] [--warmup 5]

Reads OUT/device.json and OUT/train_<run>/{config.yaml,metrics.jsonl} (single-process runs of
tools/gpu_check.sh) and writes OUT/plan_calibration.json: per run the median measured step time and
peak allocated memory (``torch.cuda.max_memory_allocated``, the trainer's ``peak_mem_gib``) against
the planner's step time and allocated memory (static + activations, without the GPU reserve and
fragmentation, which max_memory_allocated does not see), and the implied values of the cost model's
assumed constants: ``gemm_efficiency`` scaled by predicted/measured step time (compute-bound steps)
and the memory model's error. Not a step of the check: a failure leaves the file out and the check
goes on. In the CPU smoke mode the predictions are for an H100 and not comparable (recorded as such).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

DEFAULT_CORPUS_VOCAB = 4096  # the embedded corpus's tokenizer (megaloop.data.default_corpus)


def _cluster(device: dict):
    from megaloop.plan.cluster import device_cluster

    name = str(device.get("device") or "")
    over = [f"gpu_memory_gib={device['device_mem_gib']}"] if device.get("device_mem_gib") else []
    spec, base = device_cluster(name, over)  # the part's own peaks (H100 PCIe / NVL are slower than SXM)
    return spec, base, bool(device.get("cuda_available"))


def calibrate_run(run_dir: Path, cluster, warmup: int) -> dict:
    from megaloop.config import load_saved_config
    from megaloop.plan.cost import CostModel
    from megaloop.plan.layout import make_layout

    cfg = load_saved_config(run_dir / "config.yaml")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if isinstance(r.get("step"), int) and r.get("depths")][warmup:]
    if not steps:
        return {"error": f"no logged step with depths after {warmup} warm-up steps"}
    layout = make_layout(cfg, 1)
    vocab = cfg.model.vocab_size or DEFAULT_CORPUS_VOCAB
    cost = CostModel(cfg, layout, cluster, vocab)
    mm = cost.mem
    pred_t, pred_mem = [], []
    for r in steps:
        pred_t.append(cost.step(r["depths"]).step_s)
        st = mm.static(0)
        act = mm.rank_peak(0, r["depths"])
        pred_mem.append(st["params"] + st["grads"] + st["optimizer"] + max(act["peak"], mm.optimizer_phase(0)))
    meas_t = statistics.median(r["step_time_s"] for r in steps)
    mem = [r["peak_mem_gib"] for r in steps if isinstance(r.get("peak_mem_gib"), (int, float))]
    out = {"config": cfg.to_dict()["model"] | {"micro_batch_size": cfg.train.micro_batch_size,
                                               "global_batch_size": cfg.train.global_batch_size},
           "layout": layout.short(), "vocab": vocab, "steps": len(steps),
           "measured_step_s": meas_t, "predicted_step_s": statistics.median(pred_t),
           "measured_mfu": statistics.median(r["mfu"] for r in steps if "mfu" in r) if any("mfu" in r for r in steps) else None,
           "measured_peak_allocated_gib": max(mem) if mem else None,
           "predicted_peak_allocated_gib": max(pred_mem) / 2**30}
    out["step_time_ratio_measured_over_predicted"] = meas_t / out["predicted_step_s"]
    out["implied_gemm_efficiency"] = cluster.gemm_efficiency * out["predicted_step_s"] / meas_t
    if mem:
        out["memory_error"] = out["predicted_peak_allocated_gib"] / max(mem) - 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description="The planner's predictions for a tools/gpu_check.sh output folder's "
                                "training runs beside their measured step time and memory (OUT/plan_calibration.json).")
    p.add_argument("out")
    p.add_argument("--runs", nargs="*", default=["bf16"])
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    out = Path(args.out)
    try:
        device = json.loads((out / "device.json").read_text())
    except (OSError, ValueError) as err:
        p.error(f"{out / 'device.json'}: cannot be read ({getattr(err, 'strerror', None) or err}); "
                "give a gpu_check.sh output folder")
    if not isinstance(device, dict):
        p.error(f"{out / 'device.json'}: not a JSON object")
    cluster, base, cuda = _cluster(device)
    result = {"device": device.get("device"), "cluster_description": base, "comparable": cuda,
              "assumptions": {k: getattr(cluster, k) for k in ("gemm_efficiency", "comm_efficiency", "layer_overhead_us",
                                                              "reserved_gib", "fragmentation")},
              "runs": {}}
    if not cuda:
        result["note"] = "no CUDA device: predictions are for the cluster description, not this machine"
    for run in args.runs:
        d = out / f"train_{run}"
        try:
            result["runs"][run] = calibrate_run(d, cluster, args.warmup)
        except Exception as err:  # noqa: BLE001 - recorded, the check goes on
            result["runs"][run] = {"error": f"{type(err).__name__}: {err}"}
    (out / "plan_calibration.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
