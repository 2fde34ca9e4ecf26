"""Plain `lm_eval --model hf` runs the shipped task on an exported HF folder (trust_remote_code)
from a working directory other than the tasks folder (the task's data resolves beside its YAML)."""

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, clean_env

TASKS = ROOT / "megaloop" / "eval" / "tasks"


def test_lm_eval_hf_backend_on_export_from_another_directory(megatron_world, trained_run, tmp_path):
    from megaloop.hf.convert import convert_to_hf

    out = tmp_path / "hf"
    convert_to_hf(trained_run, out)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {**clean_env(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HOME": str(tmp_path / "hf_home"), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # plain lm-eval: the task folder must not rely on megaloop being importable
    cmd = [str(Path(sys.executable).with_name("lm_eval")), "--model", "hf", "--model_args",
           f"pretrained={out},trust_remote_code=True,dtype=float32", "--tasks", "megaloop_toy_mc",
           "--include_path", str(TASKS), "--limit", "8", "--device", "cpu", "--batch_size", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=cwd)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "megaloop_toy_mc" in proc.stdout and "acc" in proc.stdout
    assert not (cwd / "megaloop_toy_mc.jsonl").exists()
