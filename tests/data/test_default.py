"""Embedded default dataset, tokenizer, and the streaming import shim."""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import subprocess
import sys
from pathlib import Path

import pytest

from megaloop.data import (DataConfig, DataError, build_eval_loader, build_train_loader,
                           ensure_default_dataset, load_tokenizer)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _build(cache_dir: str, q) -> None:  # runs in a forked process
    q.put(str(ensure_default_dataset(cache_dir=cache_dir, seq_len=128)))


def test_default_dataset_builds_once_under_concurrency_and_loads(cache):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_build, args=(str(cache), q)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    roots = {q.get() for _ in procs}
    assert len(roots) == 1
    root = Path(roots.pop())
    assert root == ensure_default_dataset(cache_dir=cache, seq_len=128)  # cached: same path
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == sorted(
        [root.name, *[p.name for p in cache.glob("default-tokenizer-*")]])
    assert not list(cache.glob(".*tmp*"))
    prov = json.loads((root / "provenance.json").read_text())
    man = json.loads((root / "train" / "manifest.json").read_text())
    assert man["seq_len"] == 128 and man["vocab_size"] == 4096 and man["eos_id"] == 0
    assert man["num_sequences"] * 128 == man["total_tokens"] == prov["train"]["total_tokens"]
    assert set(man["sources"]) == {"pydoc-a", "pydoc-b"}
    assert str(root) in man["input"]  # paths recorded after the publish-rename
    for split in ("val", "screen"):
        m = json.loads((root / split / "manifest.json").read_text())
        assert m["num_sequences"] > 0 and m["seq_len"] == 128

    cfg = DataConfig(path="default", cache_dir=str(cache))
    loader = build_train_loader(cfg, seq_len=128, micro_batch_size=8, dp_rank=0, dp_size=1, seed=0)
    assert loader.manifest["num_sequences"] == man["num_sequences"]
    batch = next(iter(loader))
    assert batch["tokens"].shape == (8, 128) and int(batch["tokens"].max()) < 4096
    tok = load_tokenizer(root / "tokenizer")
    text = tok.decode(batch["tokens"][0].tolist())
    assert len(text) > 200 and text.isprintable() is False  # real multi-line English text
    val = build_eval_loader("default", seq_len=128, micro_batch_size=4, dp_rank=0, dp_size=1,
                            cache_dir=str(cache))
    assert sum(int(b["loss_mask"][:, 0].sum()) for b in val) == prov["val"]["num_sequences"]
    scr = build_eval_loader("default:screen", seq_len=128, micro_batch_size=4, dp_rank=0,
                            dp_size=1, cache_dir=str(cache))
    assert len(scr) * 4 >= prov["screen"]["num_sequences"] > 0
    with pytest.raises(Exception, match="seq_len"):
        build_eval_loader(root / "val", seq_len=64, micro_batch_size=4, dp_rank=0, dp_size=1)


def test_default_tokenizer_roundtrip_and_hf(cache):
    root = ensure_default_dataset(cache_dir=cache, seq_len=128)
    tok = load_tokenizer(root / "tokenizer" / "tokenizer.json")
    s = "def f(x):\n    return x + 1  # ünïcode ✓"
    ids = tok.encode(s)
    assert tok.decode(ids) == s and tok.vocab_size == 4096
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (0, 1, 2)
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(root / "tokenizer"))
    assert hf.eos_token_id == 0 and hf.bos_token_id == 1 and hf.pad_token_id == 2
    assert hf(s)["input_ids"] == ids and hf.decode(ids) == s


def test_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="missing.json does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "m.model").write_bytes(b"\0")
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match="sentencepiece"):
            load_tokenizer(tmp_path / "m.model")
    (tmp_path / "t.json").write_text("{}")
    with pytest.raises(DataError, match="t.json"):
        load_tokenizer(tmp_path / "t.json")


def test_import_streaming_after_megaloop_data():
    code = ("import sys, megaloop.data, streaming; "
            "assert streaming.StreamingDataset and streaming.MDSWriter; "
            "assert 'torchvision' not in sys.modules or sys.modules['torchvision'].__file__; "
            "import inspect; inspect.getmodule(print); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_loader_start_is_quick_on_cached_default(cache):
    cfg = DataConfig(path="default", cache_dir=str(cache), shuffle=False)
    lo = build_train_loader(cfg, seq_len=128, micro_batch_size=4, dp_rank=1, dp_size=2, seed=0)
    a = [b["tokens"] for b in itertools.islice(iter(lo), 3)]
    lo2 = build_train_loader(cfg, seq_len=128, micro_batch_size=4, dp_rank=1, dp_size=2, seed=0)
    b = [b["tokens"] for b in itertools.islice(iter(lo2), 3)]
    assert all((x == y).all() for x, y in zip(a, b))  # deterministic without shuffling too
