"""TP=2 (± sequence parallel) vs TP=1: logits and parameter gradients of every injection variant
and of the optional model pieces (QK-norm, normalised injection input, tied embeddings, sandwich norms,
readout C, QK biases).

torchrun --nproc_per_node 2|4 tests/distributed/model_parallel_worker.py
"""

import common  # noqa: F401  (sets sys.path, silences warnings)
import torch
from common import check, gather_tp, init_world, rel_err, set_layout

from megaloop.model.build import build_model
from megaloop.model.config import INJECTIONS, ModelConfig
from megaloop.train.grads import finalize_grads

TOL = 1e-5


# name -> ModelConfig overrides: every injection, then the optional pieces on one of them
VARIANTS = {inj: {"injection": inj} for inj in INJECTIONS}
VARIANTS["qk_norm+input_norm+tied+sandwich+readout"] = {
    "injection": "parcae_nonorm", "qk_norm": True, "input_norm": True, "tie_embeddings": True,
    "sandwich_norm": True, "state_readout": True, "state_final_norm": True}
# GQA + TP=2: tests/hf (TP=2 checkpoint); the split orthogonal QKV init must slice identically per TP rank
VARIANTS["qk_bias"] = {"injection": "huginn_linear", "qk_bias": True, "adapter_init": "normal", "adapter_bias": False,
                       "init_orthogonal": True, "qkv_init_split": True}


def run(inj: str, tp: int, sp: bool):
    cfg = ModelConfig(hidden_size=64, num_heads=4, seq_len=16, n_prelude=1, n_core=2, n_coda=1, **VARIANTS[inj])
    chunks, tc = build_model(cfg, vocab_size=250, tp=tp, pp=1, vpp=None, sequence_parallel=sp, seed=11)
    model = chunks[0]
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 250, (2, 16), generator=g)
    labels = torch.randint(0, 250, (2, 16), generator=g)
    loss = model(ids, labels=labels, depth=4, bptt_window=2, noise_seed=99)
    loss.sum().backward()
    # per-token loss path: megatron all-reduces the token count over DP and divides by it
    finalize_grads([model], num_tokens=torch.tensor(labels.numel(), dtype=torch.int))
    with torch.no_grad():
        logits = gather_tp(model(ids, depth=4, bptt_window=2, noise_seed=99), dim=-1)
    grads = {n: gather_tp(p.main_grad, p) for n, p in model.named_parameters()}
    weights = {n: gather_tp(p.data, p) for n, p in model.named_parameters()}
    return loss.detach(), logits, grads, weights


def main():
    rank, world = init_world()
    layouts = [(2, False), (2, True)] + ([(4, False), (4, True)] if world >= 4 else [])
    results = {}
    set_layout(tp=1)
    for inj in VARIANTS:
        results[(inj, 1, False)] = run(inj, 1, False)
    for tp, sp in layouts:
        set_layout(tp=tp)
        for inj in VARIANTS:
            loss, logits, grads, weights = run(inj, tp, sp)
            ref_loss, ref_logits, ref_grads, ref_w = results[(inj, 1, False)]
            check(set(grads) == set(ref_grads), f"{inj} tp={tp}: parameter names differ")
            for n in ref_w:
                check(rel_err(ref_w[n], weights[n]) == 0.0, f"{inj} tp={tp}: init of {n} differs")
            e_loss = rel_err(ref_loss, loss)
            e_logit = rel_err(ref_logits, logits)
            e_grad = max(rel_err(ref_grads[n], grads[n]) for n in ref_grads)
            worst = max(ref_grads, key=lambda n: rel_err(ref_grads[n], grads[n]))
            check(e_loss < TOL and e_logit < TOL, f"{inj} tp={tp} sp={sp}: loss {e_loss:.2e} logits {e_logit:.2e}")
            check(e_grad < TOL, f"{inj} tp={tp} sp={sp}: grad rel err {e_grad:.2e} at {worst}")
            if rank == 0:
                print(f"OK {inj:24s} tp={tp} sp={int(sp)} loss {e_loss:.1e} logits {e_logit:.1e} grads {e_grad:.1e}", flush=True)
    torch.distributed.barrier()
    if rank == 0:
        print("ALL OK")


if __name__ == "__main__":
    main()
