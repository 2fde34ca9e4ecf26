"""init_distributed at the top of train.seed's range: megatron seeds its model-parallel streams at
seed + 2718 (+ rank offsets), and the top 2,718 accepted seeds ended in a traceback
(``ValueError: Overflow when unpacking long long``), exit 1."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT, clean_env

CODE = """
import torch
from megaloop.runtime.parallel import ParallelDims, init_distributed
init_distributed(ParallelDims(world=1), {seed})
a = torch.rand(3)
torch.manual_seed({seed})
print("same" if torch.equal(a, torch.rand(3)) else "differs")
"""


def test_the_largest_seeds_start_and_keep_the_plain_seed():
    for seed in (2 ** 64 - 1, 2 ** 64 - 2718):
        proc = subprocess.run([sys.executable, "-c", CODE.format(seed=seed)], capture_output=True, text=True,
                              timeout=300, cwd=ROOT, env=clean_env())
        assert proc.returncode == 0 and proc.stdout.strip() == "same", (seed, proc.stderr[-2000:])
