"""Embedded default dataset (Python stdlib corpus), its tokenizer, and the streaming import shim."""

from __future__ import annotations

import ast
import itertools
import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megaloop.data import (DataConfig, DataError, build_eval_loader, build_train_loader,
                           ensure_default_dataset, load_tokenizer)
from megaloop.data import stdlib_corpus as sc
from megaloop.data.txt360 import HoldoutSpec, discover, read_jsonl

SOURCES = {"python-code", "python-docs", "python-tests"}
TINY_2000_STEPS = 2000 * 16 * 128  # tokens of 2,000 `tiny` steps (global batch 16 x seq_len 128)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def built(cache) -> Path:
    """The seq_len=128 dataset, built concurrently by 3 forked processes (once per module)."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_build, args=(str(cache), q)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
        assert p.exitcode == 0
    roots = {q.get() for _ in procs}
    assert len(roots) == 1
    return Path(roots.pop())


def _build(cache_dir: str, q) -> None:  # runs in a forked process
    q.put(str(ensure_default_dataset(cache_dir=cache_dir, seq_len=128)))


def _manifest(root: Path, split: str) -> dict:
    return json.loads((root / split / "manifest.json").read_text())


def test_default_dataset_builds_once_under_concurrency_and_loads(cache, built):
    root = built
    assert root == ensure_default_dataset(cache_dir=cache, seq_len=128)  # cached: same path
    names = sorted(p.name for p in cache.iterdir() if not p.name.startswith("."))
    assert len(names) == 3 and root.name in names
    assert [n.split("-")[1] for n in names if n != root.name] == ["corpus", "tokenizer"]
    assert not list(cache.glob(".*tmp*"))
    prov = json.loads((root / "provenance.json").read_text())
    man = _manifest(root, "train")
    assert man["seq_len"] == 128 and man["vocab_size"] == 4096 and man["eos_id"] == 0
    assert man["num_sequences"] * 128 == man["total_tokens"] == prov["train"]["total_tokens"]
    assert set(man["sources"]) == SOURCES
    assert str(root) in man["input"]  # paths recorded after the publish-rename
    for split in ("val", "screen"):
        m = _manifest(root, split)
        assert m["num_sequences"] > 0 and m["seq_len"] == 128

    cfg = DataConfig(path="default", cache_dir=str(cache))
    loader = build_train_loader(cfg, seq_len=128, micro_batch_size=8, dp_rank=0, dp_size=1, seed=0)
    assert loader.manifest["num_sequences"] == man["num_sequences"]
    batch = next(iter(loader))
    assert batch["tokens"].shape == (8, 128) and int(batch["tokens"].max()) < 4096
    tok = load_tokenizer(root / "tokenizer")
    text = tok.decode(batch["tokens"][0].tolist())
    assert len(text) > 200 and "\n" in text  # real multi-line text (code or prose)
    val = build_eval_loader("default", seq_len=128, micro_batch_size=4, dp_rank=0, dp_size=1,
                            cache_dir=str(cache))
    assert sum(int(b["loss_mask"][:, 0].sum()) for b in val) == prov["val"]["num_sequences"]
    scr = build_eval_loader("default:screen", seq_len=128, micro_batch_size=4, dp_rank=0,
                            dp_size=1, cache_dir=str(cache))
    assert len(scr) * 4 >= prov["screen"]["num_sequences"] > 0
    with pytest.raises(Exception, match="seq_len"):
        build_eval_loader(root / "val", seq_len=64, micro_batch_size=4, dp_rank=0, dp_size=1)


def test_default_corpus_is_big_enough_for_2000_tiny_steps_per_source(built):
    prov = json.loads((built / "provenance.json").read_text())
    assert prov["python_version"] and prov["corpus_sha256"] and set(prov["sources"]) == SOURCES
    # fewer than one epoch in 2,000 tiny steps, even counting each distinct document once
    assert prov["train"]["total_tokens"] > prov["train"]["unique_tokens"] > TINY_2000_STEPS
    val, screen = _manifest(built, "val"), _manifest(built, "screen")
    assert val["sources_without_val"] == []
    for name, s in prov["sources"].items():
        assert s["train_unique_tokens"] > 100_000 and s["train_documents"] > 500, name
        assert s["val_documents"] > 0 and s["screen_documents"] > 0, name
        assert s["val_sequences"] == val["sources"][name]["num_sequences"] == 8192 // 128, name
        assert s["documents"] == s["train_documents"] + s["val_documents"] + s["screen_documents"]
    assert screen["num_sequences"] == 64 and sum(screen["sequences_by_source"].values()) == 64


def _rows(path: Path, indices: list[int]) -> list[tuple[list[int], str]]:
    """``(tokens, source)`` of the given samples of an eval set."""
    loader = build_eval_loader(path, seq_len=128, micro_batch_size=len(indices), dp_rank=0,
                               dp_size=1, with_source=True, indices=indices)
    try:
        batch = next(iter(loader))
        return [(batch["tokens"][i].tolist(), batch["source"][i]) for i in range(len(indices))]
    finally:
        loader.close()


def test_val_and_screen_text_comes_from_held_out_documents_only(built):
    holdout = HoldoutSpec(**_manifest(built, "train")["holdout"])
    bands: dict[tuple[str, str], list[str]] = {}
    for f in discover(built / "corpus"):
        for _, text in read_jsonl(f.path):
            bands.setdefault((holdout.band(text), f.source), []).append(text)
    man = _manifest(built, "train")
    for s in SOURCES:  # the converter dropped exactly the held-out bands
        assert man["sources"][s]["docs_val"] == len(bands[("val", s)])
        assert man["sources"][s]["docs_screen"] == len(bands[("screen", s)])
    joined = {key: "\x00".join(texts) for key, texts in bands.items()}
    by_band = {b: "\x00".join(v for (b2, _), v in joined.items() if b2 == b)
               for b in ("train", "val", "screen")}
    tok = load_tokenizer(built / "tokenizer")
    for split, indices in (("val", [0, 70, 140, 191]), ("screen", [0, 21, 42, 63])):
        rows = _rows(built / split, indices)
        assert split == "screen" or {s for _, s in rows} == SOURCES
        for tokens, source in rows:
            piece = max(tok.decode(tokens).split("<|endoftext|>"), key=len)[8:-8]
            assert len(piece) > 100
            assert piece not in by_band["train"], (split, source)
            # val rows are packed per source; screen rows pool sources (a row may straddle two)
            assert piece in (joined[(split, source)] if split == "val" else by_band[split])


def test_two_builds_are_byte_identical(built, tmp_path):
    """A second build from an empty cache, in a fresh interpreter with another hash seed."""
    code = ("import sys; from megaloop.data import ensure_default_dataset; "
            "print(ensure_default_dataset(cache_dir=sys.argv[1], seq_len=128))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=600, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    other = Path(out.stdout.strip().splitlines()[-1])
    assert other.name == built.name and other != built
    files = ["tokenizer/tokenizer.json", *[f"{s}/index.json" for s in ("train", "val", "screen")],
             *[str(p.relative_to(built)) for p in sorted((built / "corpus").rglob("*.jsonl"))]]
    assert len(files) == 4 + 9  # 3 sources x 3 buckets
    for rel in files:
        assert (built / rel).read_bytes() == (other / rel).read_bytes(), rel
    a, b = (json.loads((r / "provenance.json").read_text()) for r in (built, other))
    for key in ("sources", "train", "val", "screen", "settings", "corpus_sha256"):
        assert a[key] == b[key], key


def test_second_seq_len_reuses_corpus_tree_and_tokenizer(cache, built, monkeypatch):
    """Another seq_len neither re-reads the stdlib nor retrains the BPE; a failed build leaves
    nothing behind (the conversion is stubbed to fail: real builds are covered above)."""
    import megaloop.data.bpe as bpe
    import megaloop.data.mds_convert as mds

    seen: dict = {}

    def fail(cfg):
        seen["corpus"] = sorted(p.relative_to(cfg.input).as_posix()
                                for p in Path(cfg.input).rglob("*.jsonl"))
        seen["tokenizer"] = Path(cfg.tokenizer).read_bytes()
        raise DataError("stop")

    def forbidden(*_a, **_k):
        raise AssertionError("rebuilt work that is cached")

    monkeypatch.setattr(sc, "_extract_cached", forbidden)
    monkeypatch.setattr(bpe, "train_bytelevel_bpe", forbidden)
    monkeypatch.setattr(mds, "convert_txt360", fail)
    before = sorted(p.name for p in cache.iterdir())
    with pytest.raises(DataError, match="stop"):
        ensure_default_dataset(cache_dir=cache, seq_len=64)
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == \
        [n for n in before if not n.endswith(".lock")]
    assert seen["tokenizer"] == (built / "tokenizer" / "tokenizer.json").read_bytes()
    assert seen["corpus"] == sorted(p.relative_to(built / "corpus").as_posix()
                                    for p in (built / "corpus").rglob("*.jsonl"))


def test_default_tokenizer_roundtrip_and_hf(built):
    tok = load_tokenizer(built / "tokenizer" / "tokenizer.json")
    s = "def f(x):\n    return x + 1  # ünïcode ✓"
    ids = tok.encode(s)
    assert tok.decode(ids) == s and tok.vocab_size == 4096
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (0, 1, 2)
    code = "    def __init__(self, name):\n        self.name = name\n        return None\n"
    assert len(tok.encode(code)) * 3 <= len(code)  # merges learned on Python code
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(built / "tokenizer"))
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


def _imports(module_file: Path) -> set[str]:
    """Every module a file imports, at module level or inside functions."""
    tree = ast.parse(module_file.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_no_import_cycle_between_tokenizer_and_default_corpus():
    data = ROOT / "megaloop" / "data"
    assert "megaloop.data.default_corpus" not in _imports(data / "tokenizer.py")
    for leaf in ("bpe.py", "default_tokenizer.py", "stdlib_corpus.py"):
        bad = {"megaloop.data.tokenizer", "megaloop.data.default_corpus"} & _imports(data / leaf)
        assert not bad, (leaf, bad)
    code = ("import megaloop.data.tokenizer as t, megaloop.data.default_corpus as d; "
            "assert t.train_bytelevel_bpe and d.ensure_default_tokenizer; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _fake_stdlib(root: Path) -> Path:
    (root / "pkg" / "tests").mkdir(parents=True)
    (root / "site-packages").mkdir()
    (root / "pydoc_data").mkdir()
    body = "\n\n".join(f"def f{i}(x, *, y=1):\n    '''Return x plus {i}.\n\nSecond paragraph.'''\n"
                       f"    return x + {i}\n" for i in range(600))
    (root / "pkg" / "__init__.py").write_text('"""Package docs.\n\nMore text at column 0.\n"""\n'
                                              + body + "\n\nclass C(object):\n    'A class.'\n"
                                              "    def m(self):\n        'A method.'\n")
    (root / "pkg" / "tests" / "test_x.py").write_text("def test_x():\n    assert True\n")
    (root / "site-packages" / "junk.py").write_text("x = 1\n")
    (root / "pydoc_data" / "topics.py").write_text("topics = {}\n")
    (root / "bad.py").write_bytes(b"s = '\xff'\n")
    return root


def test_stdlib_reader_on_a_fake_installation(tmp_path):
    root = _fake_stdlib(tmp_path)
    files = sc.stdlib_files(root)
    assert [(f.rel, f.source) for f in files] == [
        ("bad.py", "python-code"), ("pkg/__init__.py", "python-code"),
        ("pkg/tests/test_x.py", "python-tests")]
    ex = sc.extract(root)
    assert ex.skipped_undecodable == ("bad.py",) and ex.unparsed == ()
    code = [d for d in ex.documents if d.source == "python-code"]
    text = (root / "pkg" / "__init__.py").read_text()
    assert len(code) > 1 and "".join(d.text for d in code) == text  # cut at statement boundaries
    for d in code:
        assert d.text.count("'''") % 2 == 0 and d.text.count('"""') % 2 == 0  # no string cut
        assert len(d.text) >= sc.CODE_CHARS // 2 and d.meta["path"] == "pkg/__init__.py"
    pages = [d for d in ex.documents if d.meta.get("origin") == "python-stdlib-docstrings"]
    assert [p.parent for p in pages] == [c.text for c in code]  # one page per code chunk
    assert pages[0].text.startswith("module pkg\n    Package docs.\n\n    More text at column 0.")
    assert "def pkg.f0(x, *, y=1)\n    Return x plus 0.\n\n    Second paragraph." in pages[0].text
    assert "class pkg.C(object)\n    A class.\n\ndef pkg.C.m(self)\n    A method." in pages[-1].text
    assert [d.source for d in ex.documents if d.meta.get("path") == "pkg/tests/test_x.py"] == \
        ["python-tests"]
    holdout = HoldoutSpec(val_fraction=0.3, screen_fraction=0.3)
    kept = [d for d in sc.select(ex, holdout) if d.parent is not None]
    assert all(holdout.band(d.text) == holdout.band(d.parent) for d in kept)
    assert 0 < len(kept) < len(pages)
    assert sc.select(ex, HoldoutSpec(0.0, 0.0)) == list(ex.documents)  # no holdout: all kept


def test_fingerprint_tracks_file_contents(tmp_path):
    root = _fake_stdlib(tmp_path)
    first = sc.corpus_fingerprint(root)
    sc.corpus_fingerprint.cache_clear()
    assert sc.corpus_fingerprint(root) == first  # deterministic
    f = root / "pkg" / "tests" / "test_x.py"
    f.write_text(f.read_text().replace("True", "Fals"))  # same size, other bytes
    sc.corpus_fingerprint.cache_clear()
    assert sc.corpus_fingerprint(root) != first


def test_import_streaming_after_megaloop_data():
    code = ("import sys, megaloop.data, streaming; "
            "assert streaming.StreamingDataset and streaming.MDSWriter; "
            "assert 'torchvision' not in sys.modules or sys.modules['torchvision'].__file__; "
            "import inspect; inspect.getmodule(print); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_loader_start_is_quick_on_cached_default(cache, built):
    cfg = DataConfig(path="default", cache_dir=str(cache), shuffle=False)
    lo = build_train_loader(cfg, seq_len=128, micro_batch_size=4, dp_rank=1, dp_size=2, seed=0)
    a = [b["tokens"] for b in itertools.islice(iter(lo), 3)]
    lo2 = build_train_loader(cfg, seq_len=128, micro_batch_size=4, dp_rank=1, dp_size=2, seed=0)
    b = [b["tokens"] for b in itertools.islice(iter(lo2), 3)]
    assert all((x == y).all() for x, y in zip(a, b))  # deterministic without shuffling too


def test_a_damaged_cached_tokenizer_is_built_again_and_killed_builds_are_swept(cache, built):
    """A replaced or truncated cached tokenizer.json was used as is (a replaced one tokenised new
    datasets and was copied into runs; a truncated one failed every run naming a temp path), and every
    killed build left its temporary folder for good."""
    from megaloop.data.default_tokenizer import build_once, ensure_default_tokenizer

    path = ensure_default_tokenizer(cache)
    good = path.read_bytes()
    assert json.loads((path.parent / "provenance.json").read_text())["tokenizer_sha256"]
    path.write_bytes(good[: len(good) // 2])  # truncated
    assert ensure_default_tokenizer(cache) == path and path.read_bytes() == good  # built again, the same bytes
    prov = json.loads((path.parent / "provenance.json").read_text())  # a cache built before the record:
    del prov["tokenizer_sha256"]  # a truncated (unparsable) tokenizer is built again too
    (path.parent / "provenance.json").write_text(json.dumps(prov))
    path.write_bytes(good[:100])
    assert ensure_default_tokenizer(cache) == path and path.read_bytes() == good
    calls = []

    def build(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "provenance.json").write_text("{}")
        calls.append(tmp)

    import socket

    dead = cache / f".other.tmp-{socket.gethostname()}-999999999-abcdef"  # what a killed build of "other" leaves
    dead.mkdir()
    alive = cache / f".other.tmp-{socket.gethostname()}-{os.getpid()}-abcdef"  # a build under way here
    alive.mkdir()
    elsewhere = cache / ".other.tmp-otherhost-4242-abcdef"  # another host's (its flock may not reach here)
    elsewhere.mkdir()
    build_once(cache / "other", build)
    assert len(calls) == 1 and sorted(p.name for p in cache.glob(".other.tmp-*")) == sorted([alive.name, elsewhere.name])
    assert build_once(cache / "other", build) == cache / "other" and len(calls) == 1
