"""Prefill latency: distilled student (SPEC §10) vs the teacher at R recurrences (terminal cache).

Teacher prefill = ``model(prompt, past_key_values=new terminal cache, num_recurrences=R,
logits_to_keep=1)``; student prefill = :func:`megaloop.post.distill.prefill_student.student_prefill`
(prelude → student (a copy of the core, applied once) → one teacher recurrence → coda, same
terminal cache, last-token logits). Both fill the identical cache layout; decoding afterwards is
the same. Weights are random (latency does not depend on them). Reported: median / min latency
over ``--repeats`` interleaved rounds after one warm-up, their ratio, and the layer-pass ratio
``(n_prelude + n_student + n_core + n_coda) / (n_prelude + R·n_core + n_coda)``; the top-level
keys compare with the full depth ``--depth``, and ``by_depth`` adds the teacher at each of
``--depths`` (Table 5's prefill budgets R = 1, 2, 3, full) against the same student. Usage:
    python tools/bench/bench_distill_prefill.py [--hidden 256 --seq 512 --batch 1 --depth 5 --depths 1,2,3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import (check_model_args, command, export_model, export_model_args, int_list, model_args, positive_int,
                    sync, write_result)
from common import check_results_dir

from megaloop.post.distill.prefill_student import PrefillStudent, student_prefill


def main():
    p = argparse.ArgumentParser()
    model_args(p, seq=512, batch=1)
    p.add_argument("--depth", type=positive_int, default=5)
    p.add_argument("--repeats", type=positive_int, default=10)
    p.add_argument("--depths", type=int_list(1, optional=True), default="1,2,3",
                   help="more teacher prefill depths to time (comma-separated)")
    export_model_args(p, "distill_prefill")
    args = p.parse_args()
    check_results_dir()
    check_model_args(p, args)
    depths = sorted({int(d) for d in args.depths.split(",") if d.strip()} | {args.depth})
    model, device = export_model(args)
    cfg = model.config
    student = PrefillStudent.from_teacher(model).eval()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)

    def teacher_at(depth: int):
        @torch.no_grad()
        def teacher():
            cache = model.new_cache("terminal")
            model(ids, past_key_values=cache, num_recurrences=depth, logits_to_keep=1)
            return cache

        return teacher

    def stud():
        return student_prefill(model, student, ids)[1]

    runs = {"teacher": teacher_at(args.depth), "student": stud}
    runs.update({f"teacher_R{d}": teacher_at(d) for d in depths if d != args.depth})
    times: dict[str, list[float]] = {k: [] for k in runs}
    banks = {}
    for rep in range(args.repeats + 1):
        for name, run in runs.items():
            sync()
            t0 = time.perf_counter()
            cache = run()
            sync()
            if rep:
                times[name].append(time.perf_counter() - t0)
            banks[name] = {"num_banks": cache.num_banks(), "kv_bytes_per_token": cache.kv_bytes_per_token()}
    assert all(b == banks["student"] for b in banks.values()), banks
    stats = {name: {"median_s": statistics.median(t), "min_s": min(t), **banks[name]} for name, t in times.items()}
    res = {k: stats[k] for k in ("teacher", "student")}
    n_student = student.num_layers
    res["by_depth"] = {}
    for d in depths:
        t = stats["teacher" if d == args.depth else f"teacher_R{d}"]
        res["by_depth"][str(d)] = {
            "teacher_median_s": t["median_s"], "student_median_s": stats["student"]["median_s"],
            "ratio_median": stats["student"]["median_s"] / t["median_s"],
            "layer_pass_ratio": (cfg.n_prelude + n_student + cfg.n_core + cfg.n_coda)
            / (cfg.n_prelude + d * cfg.n_core + cfg.n_coda)}
    res["ratio_median"] = res["student"]["median_s"] / res["teacher"]["median_s"]
    res["ratio_min"] = res["student"]["min_s"] / res["teacher"]["min_s"]
    res["speedup_median"] = 1 / res["ratio_median"]
    res["layer_pass_ratio"] = ((cfg.n_prelude + n_student + cfg.n_core + cfg.n_coda)
                               / (cfg.n_prelude + args.depth * cfg.n_core + cfg.n_coda))
    for k in ("teacher", "student"):
        print(f"{k:8s} median {res[k]['median_s']*1e3:8.1f} ms  min {res[k]['min_s']*1e3:8.1f} ms")
    print(f"student/teacher latency: median {res['ratio_median']:.3f}, min {res['ratio_min']:.3f} "
          f"(layer passes {res['layer_pass_ratio']:.3f})")
    for d, r in res["by_depth"].items():
        print(f"  teacher R={d:>2}: median {r['teacher_median_s']*1e3:8.1f} ms  student/teacher {r['ratio_median']:.3f} "
              f"(layer passes {r['layer_pass_ratio']:.3f})")
    config = {**vars(args), "depths": depths, "device": device, "n_prelude": cfg.n_prelude, "n_core": cfg.n_core,
              "n_coda": cfg.n_coda, "student_layers": n_student, "intermediate_size": cfg.intermediate_size}
    write_result(args.name, config, res, command("bench_distill_prefill.py", args))


if __name__ == "__main__":
    main()
