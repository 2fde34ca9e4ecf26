"""Shared fixtures: a 1-process megatron world for in-process tests, and a torchrun launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test leaves os.environ as it found it (the session's and module's fixtures' settings
    included): the suite runs files in parallel, each worker taking files in its own order, so a
    variable one test leaves (e.g. LOCAL_RANK, which makes lm-eval report nothing) must not reach
    the next."""
    before = dict(os.environ)
    yield
    for k in set(os.environ) - set(before):
        del os.environ[k]
    for k, v in before.items():
        if os.environ.get(k) != v:
            os.environ[k] = v


@pytest.fixture(scope="session")
def megatron_world():
    """torch.distributed (gloo, 1 rank) + megatron model-parallel state at TP=PP=1."""
    from megaloop.runtime.parallel import ParallelDims, init_distributed

    init_distributed(ParallelDims(world=1), seed=1234)
    yield
    # left initialised for the whole session (tear-down races with gloo at exit otherwise)


@pytest.fixture
def one_thread():
    """Run the test with one intra-op thread (small models: threads only add scheduling noise)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def clean_env() -> dict:
    """This process's environment without torch.distributed launcher variables."""
    return {k: v for k, v in os.environ.items() if k not in DIST_VARS}


def run_torchrun(script: str | Path, nproc: int, *args: str, timeout: int = 600, env: dict | None = None) -> str:
    """Run ``script`` under torchrun with ``nproc`` gloo processes; return its output or fail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *args]
    full_env = {**clean_env(), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=full_env)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        tail = "\n".join(l for l in out.splitlines() if "warn" not in l.lower())[-6000:]
        pytest.fail(f"torchrun {Path(script).name} x{nproc} failed (exit {proc.returncode}):\n{tail}")
    return out


def tagged_json(out: str, tag: str = "RESULT") -> list[dict]:
    """Every ``TAG {json}`` record in ``out``, wherever it starts: the processes of a torchrun launch share
    one pipe, so another rank's unfinished line can precede a record on the same line."""
    dec, found, key = json.JSONDecoder(), [], tag + " "
    at = out.find(key)
    while at >= 0:
        try:
            obj, _ = dec.raw_decode(out, at + len(key))
            found.append(obj)
        except json.JSONDecodeError:
            pass
        at = out.find(key, at + len(key))
    return found


def isolated_cache(tmp_path_factory):
    """Point MEGALOOP_CACHE at a fresh directory for a test session (data tests use it autouse)."""
    old = os.environ.get("MEGALOOP_CACHE")
    os.environ["MEGALOOP_CACHE"] = str(tmp_path_factory.mktemp("megaloop_cache"))
    yield
    if old is None:
        os.environ.pop("MEGALOOP_CACHE", None)
    else:
        os.environ["MEGALOOP_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory):
    """(model, hf_dir): a tiny byte-level looped model trained briefly (tests/rl, tests/distill)."""
    import torch

    from tests.post.rl.helpers import cached_teacher

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return cached_teacher(tmp_path_factory.getbasetemp())
    finally:
        torch.set_num_threads(n)


def bpe_tokenizer(folder: Path, vocab: int = 120, words: str = "hello world, looped models think longer") -> Path:
    """``folder/tokenizer.json``: a tiny BPE tokenizer trained on ``words`` (< 250 ids) with
    megaloop's special tokens first (ids 0, 1, 2: eos, bos, pad)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|bos|>", "<|pad|>", "<unk>"],
                                  show_progress=False)
    tok.train_from_iterator([words] * 20, trainer=trainer)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"
