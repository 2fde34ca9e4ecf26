"""torchrun worker of tools/plan_validation/run.py: a few real training steps of megaloop's Trainer
(CPU, gloo) measuring what the planner predicts. Writes OUT/rank<k>.json.

    torchrun --standalone --nproc_per_node N tools/plan_validation/worker.py --mode memory|timing \
        --out DIR [--steps 3] [--config tiny] -- KEY=VALUE ...

memory: process-wide heap bytes (glibc mallinfo2, through which torch's CPU allocator goes)
    sampled after every aten op of the main thread, and the bytes of all live tensors (distinct
    storages of every tensor the garbage collector reaches: parameters, gradient buffers, optimizer
    state) at each step's start. Allocated-tensor peak of a step = tensors at its start + the heap's
    rise during it (the CPU analogue of torch.cuda.max_memory_allocated; the heap's other contents,
    Python objects and framework state, stay put during a step). (The torch profiler's allocator events
    are thread-local: frees made on gloo's worker threads are missing from them, so they drift.)
timing: megatron's ``schedules.forward_step`` / ``backward_step`` are wrapped with timers; per step
    each rank records (kind, microbatch, chunk, t0, t1) of every compute op and the schedule's start
    (after a barrier); ``time.perf_counter`` is CLOCK_MONOTONIC, shared by the processes of one
    machine. A p2p ping-pong of the [2s, b, d] stage tensor between pipeline ranks 0 and 1 gives the
    transfer time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

import torch  # noqa: E402


def _tensor_bytes() -> int:
    """Bytes of the distinct storages of every CPU tensor the garbage collector can reach."""
    import gc

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if torch.is_tensor(obj) and obj.device.type == "cpu" and not obj.is_meta:
                st = obj.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        except Exception:  # noqa: BLE001 - exotic tensor subclasses
            continue
    return sum(seen.values())


class _Heap:
    """Process-wide bytes malloc has handed out (glibc ``mallinfo2``: ``uordblks + hblkhd``, all
    arenas and threads; torch's CPU allocator allocates through malloc), sampled after every aten
    op of the main thread (a TorchDispatchMode; CPU autograd runs its backward on the same thread).
    Unlike the profiler's events it also sees frees made on gloo's worker threads."""

    def __init__(self) -> None:
        import ctypes

        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]

        self.libc = ctypes.CDLL("libc.so.6")
        self.libc.mallinfo2.restype = MallInfo2
        self.peak = 0

    def now(self) -> int:
        m = self.libc.mallinfo2()
        return int(m.uordblks + m.hblkhd)

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        heap = self

        class Sampler(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                heap.peak = max(heap.peak, heap.now())
                return out

        return Sampler()


def _p2p_time(seq: int, mbs: int, d: int, dtype: torch.dtype, reps: int = 12) -> float | None:
    """Median one-way time of a [2s, b, d] send between pipeline ranks 0 and 1 (seconds)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() < 2:
        return None
    group = ps.get_pipeline_model_parallel_group()
    ranks = torch.distributed.get_process_group_ranks(group)
    me = ps.get_pipeline_model_parallel_rank()
    x = torch.zeros(2 * seq, mbs, d, dtype=dtype)
    times = []
    for _ in range(reps):
        torch.distributed.barrier(group=group)
        t0 = time.perf_counter()
        if me == 0:
            torch.distributed.send(x, ranks[1])
            torch.distributed.recv(x, ranks[1])
        elif me == 1:
            torch.distributed.recv(x, ranks[0])
            torch.distributed.send(x, ranks[0])
        times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times[2:]) if me in (0, 1) else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("memory", "timing"), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--config", default="tiny")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from megaloop.config import load_config
    from megaloop.train.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    out = Path(args.out)
    run_dir = out / "run"
    heap = _Heap() if args.mode == "memory" else None
    heap_base = heap.now() if heap else 0
    tr = Trainer(cfg, run_dir)
    tr.setup()
    from megatron.core import parallel_state as ps

    rank = torch.distributed.get_rank()
    info = {"rank": rank, "pp_rank": ps.get_pipeline_model_parallel_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
            "dp_rank": ps.get_data_parallel_rank(), "pp": tr.dims.pp, "vpp": tr.dims.vpp or 1, "tp": tr.dims.tp,
            "dp": tr.dp, "microbatches": tr.M, "vocab": tr.vocab, "overrides": args.overrides, "steps": []}
    if args.mode == "memory":
        import gc

        info["heap"] = {"baseline": heap_base, "after_setup": heap.now()}
        for i in range(args.steps):
            gc.collect()
            tensors = _tensor_bytes()
            start = heap.now()
            heap.peak = start
            with heap.mode():
                rec = tr.train_step()
            gc.collect()
            info["heap"][f"step{i}"] = {"tensors_at_start": tensors, "level_at_start": start, "peak": heap.peak,
                                        "level_at_end": heap.now()}
            info["steps"].append({"depths": rec["depths"], "loss": rec["loss"]})
    else:
        info["p2p_s"] = _p2p_time(cfg.model.seq_len, cfg.train.micro_batch_size, cfg.model.hidden_size,
                                  torch.bfloat16 if cfg.model.bf16 else torch.float32)
        _timing(tr, args.steps, info)
    (out / f"rank{rank}.json").write_text(json.dumps(info))
    torch.distributed.barrier()


def _timing(tr, steps: int, info: dict) -> None:
    from megatron.core.pipeline_parallel import schedules

    from megaloop.model.build import unwrap

    ops: list = []
    cur: dict = {}
    owner: dict = {}
    f_orig, b_orig = schedules.forward_step, schedules.backward_step
    fs_orig = tr._forward_step

    class _Peek:
        def __init__(self, it):
            self.it = it

        def __iter__(self):
            return self

        def __next__(self):
            cur["mb"] = next(self.it)
            return cur["mb"]

    def forward_step_func(data_iterator, model):
        return fs_orig(_Peek(data_iterator), model)

    def forward_step(forward_step_func_, data_iterator, model, *a, **kw):
        t0 = time.perf_counter()
        res = f_orig(forward_step_func_, data_iterator, model, *a, **kw)
        t1 = time.perf_counter()
        chunk = unwrap(model).vp_stage or 0
        mb = cur["mb"]["index"]
        out = res[0][0] if isinstance(res[0], list) else res[0]
        owner[id(out)] = (mb, chunk)
        ops.append(("F", mb, chunk, t0, t1))
        return res

    def backward_step(input_tensor, output_tensor, *a, **kw):
        t0 = time.perf_counter()
        res = b_orig(input_tensor, output_tensor, *a, **kw)
        t1 = time.perf_counter()
        out = output_tensor[0] if isinstance(output_tensor, list) else output_tensor
        mb, chunk = owner.pop(id(out))
        ops.append(("B", mb, chunk, t0, t1))
        return res

    run_orig = tr._run_schedule

    def run_schedule(mbs, forward_only, seq_len=None):
        ops.clear()
        torch.distributed.barrier()
        start = time.perf_counter()
        res = run_orig(mbs, forward_only, seq_len)
        info["steps"].append({"start": start, "ops": list(ops), "depths": [m["depth"] for m in mbs]})
        return res

    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    comm_orig = P2PCommunicator._communicate
    comms = info.setdefault("comm", [])

    def communicate(self, **kw):
        t0 = time.perf_counter()
        res = comm_orig(self, **kw)
        what = "".join(c for c, on in (("s", kw.get("tensor_send_next") is not None),
                                        ("S", kw.get("tensor_send_prev") is not None),
                                        ("r", kw.get("recv_prev")), ("R", kw.get("recv_next"))) if on)
        comms.append((what, t0, time.perf_counter()))
        return res

    P2PCommunicator._communicate = communicate
    schedules.forward_step, schedules.backward_step = forward_step, backward_step
    tr._forward_step = forward_step_func
    tr._run_schedule = run_schedule
    try:
        for _ in range(steps):
            tr.train_step()
    finally:
        schedules.forward_step, schedules.backward_step = f_orig, b_orig
        P2PCommunicator._communicate = comm_orig


if __name__ == "__main__":
    main()
