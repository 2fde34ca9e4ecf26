"""`lm_eval --model hf` runs a local task on an exported HF folder (trust_remote_code)."""

import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import ROOT, clean_env

TASKS = ROOT / "megaloop" / "eval" / "tasks"


def test_lm_eval_hf_backend_on_export(megatron_world, trained_run, tmp_path):
    from megaloop.hf.convert import convert_to_hf

    out = tmp_path / "hf"
    convert_to_hf(trained_run, out)
    spec = yaml.safe_load((TASKS / "megaloop_toy_mc.yaml").read_text())
    spec["dataset_kwargs"]["data_files"]["test"] = str(TASKS / "megaloop_toy_mc.jsonl")
    inc = tmp_path / "tasks"
    inc.mkdir()
    (inc / "megaloop_toy_mc.yaml").write_text(yaml.safe_dump(spec))
    env = {**clean_env(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HOME": str(tmp_path / "hf_home"), "OMP_NUM_THREADS": "1"}
    cmd = [str(Path(sys.executable).with_name("lm_eval")), "--model", "hf", "--model_args",
           f"pretrained={out},trust_remote_code=True,dtype=float32", "--tasks", "megaloop_toy_mc",
           "--include_path", str(inc), "--limit", "8", "--device", "cpu", "--batch_size", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "megaloop_toy_mc" in proc.stdout and "acc" in proc.stdout
