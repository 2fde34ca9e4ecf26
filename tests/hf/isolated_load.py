"""Run with ``python -I`` from a temp dir: load exported folders WITHOUT megaloop/megatron.

    python -I isolated_load.py RESULT.pt FOLDER [FOLDER ...]

A meta-path finder makes ``import megaloop`` / ``import megatron`` fail (the repo is installed
in editable mode, so isolation alone would still find it). Each folder is loaded with
``AutoModelForCausalLM.from_pretrained(trust_remote_code=True)``; logits of ``FOLDER/ids.pt``
(use_cache=False, configured depth) and a short greedy generation are saved to RESULT.pt.
"""

import importlib.abc
import sys

BLOCKED = ("megaloop", "megatron")


class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this isolated check")
        return None


sys.meta_path.insert(0, _Block())
sys.modules["sklearn"] = None  # not needed; transformers' optional sklearn import costs seconds
for mod in BLOCKED:
    try:
        __import__(mod)
    except ImportError:
        pass
    else:
        print(f"FAIL: {mod} is importable", flush=True)
        sys.exit(3)

import torch  # noqa: E402
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

torch.set_num_threads(1)
result = {}
for folder in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    ids = torch.load(f"{folder}/ids.pt")
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
        gen = model.generate(ids[:, :8], max_new_tokens=4, do_sample=False)
    entry = {"logits": logits, "generate": gen, "num_recurrences": model.config.num_recurrences}
    base = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()  # auto_map
    with torch.no_grad():
        entry["automodel"] = (type(base).__name__, float((base(input_ids=ids, use_cache=False).last_hidden_state
                                                          - model.model(input_ids=ids, use_cache=False)
                                                          .last_hidden_state).abs().max()))
    try:
        tok = AutoTokenizer.from_pretrained(folder)
        entry["tokens"] = tok("hello world")["input_ids"]
        entry["eos"] = tok.eos_token
        entry["padding_side"] = tok.padding_side
        # a tokenizer-padded batch of two prompts of different lengths: each row continues as alone
        enc = tok(["hello world , looped models", "think"], return_tensors="pt", padding=True)
        with torch.no_grad():
            both = model.generate(**enc, max_new_tokens=4, do_sample=False)
            alone = model.generate(tok(["think"], return_tensors="pt").input_ids, max_new_tokens=4, do_sample=False)
        entry["padded_batch_ok"] = bool(torch.equal(both[1, -alone.shape[1]:], alone[0]))
    except (OSError, ValueError):
        pass
    over = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, num_recurrences=8,
                                                kv_cache_mode="per_visit")
    entry["override"] = (over.config.num_recurrences, over.config.kv_cache_mode)
    result[folder] = entry
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
if leaked:
    print(f"FAIL: imported {leaked}", flush=True)
    sys.exit(4)
torch.save(result, sys.argv[1])
print("ISOLATED OK", len(result), flush=True)
