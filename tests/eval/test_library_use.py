"""megaloop from a notebook: loading a checkpoint leaves the caller's process as it was. It reseeded
Python's, numpy's and torch's generators with the run's seed, and a failed load left megaloop's CPU
layer on, so the caller's ``torch.zeros(1, device="cuda")`` silently became a CPU tensor."""

from __future__ import annotations

import shutil
import subprocess
import sys

from tests.conftest import ROOT, clean_env

SCRIPT = """
import random, sys
import numpy as np, torch
from megaloop.inference.engine import InferenceEngine
from megaloop.runtime.cpu_compat import redirect_active

def draws():
    return (random.random(), float(np.random.rand()), float(torch.rand(1)))

def seeded():
    random.seed(0); np.random.seed(0); torch.manual_seed(0)

seeded(); want = draws()
seeded()
try:
    InferenceEngine.from_checkpoint(sys.argv[2])
except Exception as err:
    print("bad load:", type(err).__name__)
print("redirect after a failed load:", redirect_active())
print("same draws after a failed load:", draws() == want)
seeded()
eng = InferenceEngine.from_checkpoint(sys.argv[1])
print("same draws after a load:", draws() == want)
print("redirect after a load:", redirect_active())
"""


def test_loading_a_checkpoint_leaves_the_callers_generators_and_torch_alone(trained_run, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(trained_run / "checkpoints", bad / "checkpoints")
    for shard in (bad / "checkpoints").rglob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])  # truncated: the load fails after megatron started
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(trained_run), str(bad)], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "bad load: CheckpointError" in out, out + proc.stderr[-2000:]
    for line in ("redirect after a failed load: False", "same draws after a failed load: True",
                 "same draws after a load: True", "redirect after a load: False"):
        assert line in out, (line, out)


def test_plotting_leaves_the_callers_matplotlib_backend(tmp_path):
    """plot_sweep / plot_synth forced matplotlib's backend to Agg: a notebook's inline backend was gone."""
    code = f"""
import matplotlib
matplotlib.use("svg")
from megaloop.eval.depth_sweep import plot_sweep
from megaloop.eval.synth import SynthTable, plot_synth
plot_sweep({{"rows": [{{"depth": 1, "native_ppl": 10.0}}, {{"depth": 4, "native_ppl": 9.0}}], "reference_depth": 4}},
           {str(tmp_path / "s.png")!r})
plot_synth(SynthTable(ks=[1, 2], depths=[1, 4], n=[5, 5], acc=[[1.0, 1.0], [0.2, 0.8]], ce=[[0.1, 0.1], [1.5, 0.3]],
                      chance=0.2), {str(tmp_path / "t.png")!r})
print(matplotlib.get_backend())
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "svg", proc.stdout + proc.stderr[-2000:]
    assert (tmp_path / "s.png").read_bytes()[:4] == (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
