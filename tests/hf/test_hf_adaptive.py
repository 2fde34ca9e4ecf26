"""HF export's adaptive depth: ``generate(exit_criterion=..., min_depth=..., max_depth=...)`` equals the
inference engine's adaptive generation on the same weights — in this process and in a fresh
``python -I`` interpreter where ``import megaloop`` fails (the folder's remote code alone)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megaloop.hf.convert import AUTO_MAP, CODE_FILES, HF_DIR
from megaloop.inference.engine import InferenceEngine
from tests.inference.helpers import make_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = torch.tensor([[5, 9, 2, 14, 7, 3], [11, 4, 4, 20, 8, 30]])
NEW = 6
CASES = [("kl:1e-3", 2, 12), ("argmax:3", 3, 10), ("latent:0.05", 2, 8)]

ISOLATED = r"""
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("megaloop", "megatron"):
            raise ImportError(name + " is blocked in this isolated check")
sys.meta_path.insert(0, _Block())
sys.modules["sklearn"] = None
import torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
folder, out, cases = sys.argv[1], sys.argv[2], eval(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
ids = torch.load(folder + "/ids.pt")
res = {}
for crit, lo, hi in cases:
    g = model.generate(ids, max_new_tokens=%d, do_sample=False, exit_criterion=crit, min_depth=lo, max_depth=hi,
                       return_dict_in_generate=True)
    res[crit] = (g.sequences, torch.stack(g.past_key_values.exit_depths, 1))
assert not [m for m in sys.modules if m.split(".")[0] in ("megaloop", "megatron")]
torch.save(res, out)
print("ISOLATED OK")
""" % NEW


def export(model, folder: Path) -> Path:
    """``model`` saved as a remote-code folder, the way ``convert_to_hf`` writes one."""
    model.config.auto_map = dict(AUTO_MAP)
    model.config.eos_token_id = None  # never stop early: compare full-length generations
    model.generation_config.eos_token_id = None
    model.generation_config.suppress_tokens = list(range(model.config.tokenizer_vocab_size, model.config.vocab_size))
    model.save_pretrained(str(folder))
    for name in CODE_FILES:
        shutil.copyfile(HF_DIR / name, folder / name)
    torch.save(PROMPTS, folder / "ids.pt")
    return folder


def engine_reference(model):
    eng = InferenceEngine(model, None, depth=3, cache_mode="terminal")
    ref = {}
    for crit, lo, hi in CASES:
        out = eng.generate(PROMPTS.tolist(), max_new_tokens=NEW, exit_criterion=crit, min_depth=lo, max_depth=hi,
                           stop_at_eos=False)
        ref[crit] = (torch.cat([PROMPTS, torch.tensor([r.token_ids for r in out.results])], 1),
                     torch.tensor([r.depths for r in out.results]))
    return ref


def test_export_code_files_are_self_contained():
    """Every relative import of the exported remote code is itself exported."""
    import re

    for name in CODE_FILES:
        for dep in re.findall(r"^\s*from\s+\.(\w+)\s+import", (HF_DIR / name).read_text(), flags=re.MULTILINE):
            assert f"{dep}.py" in CODE_FILES, f"{name} imports .{dep}, which convert.CODE_FILES does not export"


def test_hf_generate_adaptive_equals_engine(tmp_path):
    model = make_model(seed=5, num_recurrences=3)
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    model.generation_config.suppress_tokens = list(range(32, 48))
    ref = engine_reference(model)
    depth_sets = set()
    for crit, lo, hi in CASES:
        g = model.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, exit_criterion=crit, min_depth=lo,
                           max_depth=hi, return_dict_in_generate=True)
        depths = torch.stack(g.past_key_values.exit_depths, 1)
        assert torch.equal(g.sequences, ref[crit][0]), crit
        assert torch.equal(depths, ref[crit][1]), crit
        assert int(depths.min()) >= lo and int(depths.max()) <= hi
        depth_sets |= set(depths.flatten().tolist())
    assert len(depth_sets) > 1  # the cases exercise more than one exit depth
    # config fields work as defaults (from_pretrained overrides); fixed depth without them
    model.config.exit_criterion, model.config.max_depth = "kl:1e-3", 12
    g = model.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(g.sequences, ref["kl:1e-3"][0])
    model.config.exit_criterion = None
    g = model.generate(PROMPTS, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    assert g.past_key_values.exit_depths == []
    with pytest.raises(ValueError, match="exit_criterion: unknown criterion 'entropy'"):
        model.generate(PROMPTS, max_new_tokens=2, exit_criterion="entropy:1")
    # without a cache every step is a full forward: the criterion was ignored without a word
    with pytest.raises(ValueError, match=r"exit_criterion: adaptive depth runs in cached one-token decode steps"):
        model.generate(PROMPTS, max_new_tokens=2, do_sample=False, use_cache=False, exit_criterion="argmax:2")
    assert model.generate(PROMPTS, max_new_tokens=2, do_sample=False, use_cache=False).shape == (PROMPTS.shape[0],
                                                                                              PROMPTS.shape[1] + 2)


def test_isolated_export_adaptive_generate_equals_engine(tmp_path):
    model = make_model(seed=5, num_recurrences=3)
    folder = export(model, tmp_path / "hf")
    ref = engine_reference(model)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    script = tmp_path / "isolated_adaptive.py"
    script.write_text(ISOLATED)
    out = tmp_path / "result.pt"
    proc = subprocess.run([sys.executable, "-I", str(script), str(folder), str(out), repr(CASES)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ISOLATED OK" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    got = torch.load(out)
    for crit, _, _ in CASES:
        assert torch.equal(got[crit][0], ref[crit][0]), crit
        assert torch.equal(got[crit][1], ref[crit][1]), crit
