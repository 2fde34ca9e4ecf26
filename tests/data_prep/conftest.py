"""Fixtures: a small TxT360-layout tree (2 sources x 3 buckets) and a tokenizer trained on it."""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from pathlib import Path

import pytest

from tests.conftest import isolated_cache

WORDS = ("the of and to in is was for on that with as by at from his her an which are this be "
         "had were not but have it one their all there when can out who more been if its also "
         "river mountain valley city harbor castle forest meadow bridge tower market school "
         "music painting theory number signal memory engine garden winter summer autumn spring "
         "north south east west quickly slowly brightly quietly loudly gently ancient modern "
         "small large early late bright dark simple complex open closed golden silver").split()
# (source, bucket) -> list of files (name, number of docs)
LAYOUT = {
    ("alpha", "1-1"): [("0_2.jsonl", 50), ("1_2.jsonl", 40)],
    ("alpha", "2-5"): [("0_1.jsonl", 70)],
    ("alpha", "6-10"): [("0_1.jsonl.gz", 60)],
    ("beta", "1-1"): [("0_1.jsonl", 80)],
    ("beta", "2-5"): [("0_1.jsonl", 60)],
    ("beta", "6-10"): [("0_1.jsonl", 50)],
}


def make_doc(rng: random.Random) -> str:
    n = rng.randint(30, 50)
    words = [rng.choice(WORDS) for _ in range(n)]
    return " ".join(words).capitalize() + "."


def write_tree(root: Path, seed: int = 0) -> dict[tuple[str, str], list[str]]:
    """Write the fixture tree under ``root/data``; returns the texts per (source, bucket)."""
    rng = random.Random(seed)
    texts: dict[tuple[str, str], list[str]] = {}
    for (src, bucket), files in LAYOUT.items():
        for name, n in files:
            docs = [make_doc(rng) for _ in range(n)]
            texts.setdefault((src, bucket), []).extend(docs)
            lines = "".join(json.dumps({"text": d, "meta": {"url": f"https://x/{i}", "dup": bucket}})
                            + "\n" for i, d in enumerate(docs))
            write_text_file(root / "data" / src / bucket / name, lines)
    return texts


def write_text_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (parents created), gzipped when the name ends in ``.gz``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)


# keep shard caches of these tests out of the user's ~/.cache/megaloop
_isolated_megaloop_cache = pytest.fixture(scope="session", autouse=True)(isolated_cache)


@pytest.fixture(scope="session")
def txt360_tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("txt360")
    return root, write_tree(root)


@pytest.fixture(scope="session")
def fixture_tokenizer(tmp_path_factory: pytest.TempPathFactory, txt360_tree) -> Path:
    from megaloop.data.tokenizer import train_bytelevel_bpe

    _, texts = txt360_tree
    out = tmp_path_factory.mktemp("tok")
    return train_bytelevel_bpe((t for ts in texts.values() for t in ts), out, vocab_size=400)


def load_tool(name: str, tag: str):
    """``data_prep/NAME.py`` imported as a module (its ``main``/``check_args`` called in-process);
    ``tag`` keeps each test file's copy apart in ``sys.modules``."""
    path = Path(__file__).resolve().parents[2] / "data_prep" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_{tag}_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
