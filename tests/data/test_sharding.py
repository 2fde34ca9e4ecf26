"""TP=2 x DP=2 over 4 gloo ranks: batches follow the data-parallel rank, not the global rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megaloop.data.synthetic import write_synthetic_mds

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "distributed" / "data_sharding_worker.py"


@pytest.mark.distributed
def test_tp_ranks_share_batches_and_dp_replicas_partition(tmp_path):
    data = tmp_path / "synth"
    write_synthetic_mds(data, num_sequences=64, seq_len=16, vocab_size=512, size_limit=1 << 11)
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--monitor-interval", "0.1",
           "--nproc_per_node", "4",
           str(WORKER), "--data", str(data), "--tp", "2", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGALOOP_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.is_file(), (proc.stdout + proc.stderr)[-4000:]
    res = json.loads(out.read_text())
    assert res["tp_identical"], res
    assert res["replicas_disjoint"], res
    assert res["union_is_dataset"], res
    assert res["state_identical"] and res["env_unchanged"], res
    assert res["samples_per_replica"] == {"0": 32, "1": 32} and res["batches_per_rank"] == 8
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
