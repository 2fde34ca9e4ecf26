"""TxT360 layout: file discovery, mixture weights / bucket upsampling, and content-hash holdout.

Layout: ``ROOT/data/<source>/<dup-bucket>/<i>_<n>.jsonl[.gz]`` (``ROOT`` may also be the ``data``
directory itself, and extra directory levels such as a CommonCrawl dump name are allowed; any
folder may be a symlink, followed once per real folder). The bucket is the first path component
below ``<source>`` that names a duplicate-count bucket; files outside a bucket get bucket ``none``.
Each JSONL record holds ``text`` (str) and ``meta`` (object).

Mixing: every document of (source, bucket) is repeated ``m = source_weight * bucket_upsample``
times on average: ``floor(m)`` copies each, plus one more copy for the ``round(frac(m) * n)``
documents of its file with the smallest seeded content hash (so ``m < 1`` downsamples). Weights are
relative repetition factors, not target shares.

Holdout: a document whose salted content hash ``u`` in [0, 1) is below ``val_fraction`` belongs to
the validation band, below ``val_fraction + screen_fraction`` to the LR-screen band; both bands are
excluded from training. Hashing the text (not its location) keeps exact duplicates of a held-out
document, in any bucket or file, out of training too.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import re
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from megaloop.data.errors import DataError

# the release names Common Crawl's top bucket "1001-30000000" (the curated sources' is "1001-inf"): a bucket
# of its own, weighted as the top bucket by default (before this release its files fell to "none", x1 not x5)
BUCKETS = ("1-1", "2-5", "6-10", "11-100", "101-1000", "1001-inf", "1001-30000000")
NO_BUCKET = "none"
LFS_POINTER = b"version https://git-lfs"
# Default repetition per duplicate-count bucket: about one more copy per bucket step, capped at 5
# so boilerplate that survives in thousands of crawls does not dominate. Configurable.
DEFAULT_BUCKET_UPSAMPLE: dict[str, float] = {
    "1-1": 1.0, "2-5": 2.0, "6-10": 3.0, "11-100": 4.0, "101-1000": 5.0, "1001-inf": 5.0, "1001-30000000": 5.0,
    NO_BUCKET: 1.0,
}


@dataclass(frozen=True)
class InputFile:
    """One JSONL file of the tree; ``part`` is its partition name (relative path sans suffix)."""

    path: Path
    source: str
    bucket: str
    part: str


def data_root(root: str | Path) -> Path:
    """``ROOT/data`` if it exists, else ``ROOT``; errors name a missing directory."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise DataError(f"input {root} is a file; pass the TxT360 root (holding data/) or its data/ folder")
    if not root.is_dir():
        raise DataError(f"input directory {root} does not exist")
    return root / "data" if (root / "data").is_dir() else root


_BUCKET_LIKE = re.compile(r"^\d+-(\d+|inf)$")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800..\udfff in a JSON line


def _note(msg: str) -> None:
    print(f"note: {msg}", file=sys.stderr)


def discover(root: str | Path, sources: list[str] | None = None) -> list[InputFile]:
    """All ``*.jsonl`` / ``*.jsonl.gz`` files per source, sorted; errors if there are none.

    Errors: a source folder passed as the root (its subfolders are bucket names, or it sits in a
    ``data/`` folder whose other sources hold buckets: its dump folders would become sources), a
    source folder that is a link to nothing (an unmounted disk; unless ``sources`` leaves it out),
    two files that map to one partition (``x.jsonl`` beside ``x.jsonl.gz``). Notes on stderr: files that are not
    read (other suffixes, files directly under ``data/``), sources without any JSONL file, and
    folders named like a bucket that is not one of :data:`BUCKETS` (read as bucket ``none``).
    Links to folders (a source folder or any folder below one) are followed, each real folder read
    once; links that would loop or reach a folder a second time are noted (:func:`_walk_sources`)."""
    data = data_root(root)
    found: list[InputFile] = []
    entries = sorted(p for p in data.iterdir() if not p.name.startswith("."))
    src_dirs = [p for p in entries if p.is_dir()]
    known = [p.name for p in src_dirs]
    as_buckets = [n for n in known if n in BUCKETS]
    if as_buckets:
        raise DataError(f"--input {root}: {data} holds duplicate-count bucket folders {as_buckets}, so it is "
                        "one source's folder; pass the TxT360 root (holding data/) or its data/ folder, "
                        "and --sources NAME to convert one source")
    outer = _data_folder_around(data)
    if outer is not None:
        raise DataError(f"--input {root} is the source folder {data.name!r} of {outer} (whose other sources hold "
                        f"duplicate-bucket folders): its subfolders {known[:5]} would be read as sources; pass "
                        f"{outer.parent} (or {outer}) and --sources {data.name} to convert one source")
    # a source folder that is a link to nothing (an unmounted disk): reading on would drop the source
    broken = [p for p in entries if p.is_symlink() and not p.exists() and (not sources or p.name in sources)]
    if broken:
        links = ", ".join(f"{p} -> {os.readlink(p)}" for p in broken[:5])
        raise DataError(f"{len(broken)} source folder(s) under {data} are links to folders that do not exist "
                        f"(an unmounted disk?): {links}; mount them, or remove the link(s) to go on without "
                        "those sources")
    loose = sorted(p.name for p in data.iterdir() if p.is_file() and not p.name.startswith("."))
    if loose:
        _note(f"{len(loose)} file(s) directly under {data} are not read (files live in data/<source>/...): "
              f"{loose[:5]}")
    for want in sources or []:
        if want not in known:
            raise DataError(f"source {want!r} not found under {data} (found: {known})")
    walked = _walk_sources(data, [d for d in src_dirs if not sources or d.name in sources])
    for sdir, every in walked.items():  # one walk of each source's tree, links to folders followed
        files = sorted(f for f in every if f.name.endswith((".jsonl", ".jsonl.gz")))
        other = sorted(str(f.relative_to(data)) for f in every
                       if not f.name.endswith((".jsonl", ".jsonl.gz")) and not f.name.startswith("."))
        if other:
            _note(f"{len(other)} file(s) under {sdir} are not .jsonl/.jsonl.gz and are not read: {other[:5]}")
        if not files:
            _note(f"source {sdir.name!r} has no .jsonl/.jsonl.gz file and is skipped")
        odd = sorted({p for f in files for p in f.relative_to(sdir).parts[:-1]
                      if _BUCKET_LIKE.match(p) and p not in BUCKETS})
        if odd:
            _note(f"{sdir}: folder(s) {odd} look like duplicate buckets but are not one of {list(BUCKETS)}; "
                  f"their files get bucket {NO_BUCKET!r} (upsampled as --bucket-upsample {NO_BUCKET}=X says, "
                  f"default {DEFAULT_BUCKET_UPSAMPLE[NO_BUCKET]:g})")
        for f in files:
            rel = f.relative_to(sdir).parts
            bucket = next((p for p in rel[:-1] if p in BUCKETS), NO_BUCKET)
            stem = f.name[: -len(".jsonl.gz")] if f.name.endswith(".gz") else f.name[: -len(".jsonl")]
            part = "/".join((sdir.name, *rel[:-1], stem))
            found.append(InputFile(path=f, source=sdir.name, bucket=bucket, part=part))
    seen: dict[str, InputFile] = {}
    for f in found:
        flat = part_dirname(f.part)  # the converter's parts/<flat>/ folder of the file
        if flat in seen:
            other = seen[flat]
            why = ("the same name with and without .gz" if other.part == f.part else
                   f"{other.part!r} and {f.part!r} both flatten to the folder name {flat!r}, as '/' becomes '__'")
            raise DataError(f"{other.path} and {f.path} would be the same partition ({why}); keep one of them "
                            "or rename one")
        seen[flat] = f
    if not found:
        raise DataError(f"no .jsonl or .jsonl.gz files under {data} "
                        f"(expected data/<source>/<bucket>/<i>_<n>.jsonl[.gz])")
    return found


def _holds_bucket(folder: Path, depth: int) -> bool:
    """Whether a duplicate-bucket folder lies at most ``depth`` levels below ``folder``."""
    try:
        subs = sorted((e for e in os.scandir(folder) if e.is_dir()), key=lambda e: e.name)
    except OSError:
        return False
    if any(e.name in BUCKETS for e in subs):
        return True
    return depth > 1 and any(_holds_bucket(Path(e.path), depth - 1) for e in subs[:50])


def _data_folder_around(data: Path) -> Path | None:
    """The TxT360 ``data/`` folder that ``data`` (an ``--input`` without a ``data/`` of its own) is
    one source folder of: its parent is named ``data`` and another folder there holds duplicate
    buckets (directly or below one dump level). Such an input would turn the source's dump folders
    into sources. None when ``data`` is not such a folder."""
    if data.name == "data":
        return None
    for here in dict.fromkeys((Path(os.path.abspath(data)), data.resolve())):
        parent = here.parent
        if here.name == "data" or parent.name != "data":
            continue
        try:
            siblings = sorted(p for p in parent.iterdir() if p.name != here.name and not p.name.startswith("."))
        except OSError:
            continue
        if any(p.is_dir() and _holds_bucket(p, 2) for p in siblings[:50]):
            return parent
    return None


def check_out_outside_input(root: str | Path, out: str | Path, flag: str = "--out") -> None:
    """Refuse an output folder inside the input tree's ``data/`` folder (or one of its linked source
    folders): what a tool writes there would be read as a source of its own by the next run."""
    data = data_root(root)
    target = Path(os.path.abspath(out)).resolve()
    inside = [data] + [p for p in sorted(data.iterdir()) if p.is_symlink() and p.is_dir()]
    for d in inside:
        real = d.resolve()
        if target == real or real in target.parents:
            raise DataError(f"{flag} {out} is inside the input tree ({d}): what it writes there would be read as "
                            f"input by the next run; choose a folder outside {data}")


def _dir_key(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _walk_sources(data: Path, src_dirs: list[Path]) -> dict[Path, list[Path]]:
    """Every file under each source folder (paths as reached, below the source folder), following
    links to folders. Each real folder is read once: the folders reached without a link first, then
    the linked ones in sorted order; a link to a folder above it (a loop) and a second way to a
    folder already read are not followed, and are listed on stderr (so are dangling links and
    folders that cannot be listed)."""
    seen: dict[tuple[int, int], Path] = {}  # real folder -> the path it is read as
    root_key = _dir_key(data)
    if root_key:
        seen[root_key] = data
    out: dict[Path, list[Path]] = {}
    links: list[tuple[Path, Path]] = []  # (source folder, linked folder), followed after the real tree
    loops: list[str] = []
    again: list[str] = []
    dangling: list[str] = []
    unreadable: list[str] = []

    def claim(d: Path) -> bool:
        key = _dir_key(d)
        if key is None:
            unreadable.append(f"{d} (cannot stat)")
            return False
        if key in seen:
            first = seen[key]
            (loops if first == d or first in d.parents else again).append(f"{d} -> {first}")
            return False
        seen[key] = d
        return True

    def walk(sdir: Path, top: Path) -> None:
        stack = [top]
        while stack:
            d = stack.pop()
            try:
                entries = sorted(os.scandir(d), key=lambda e: e.name)
            except OSError as err:
                unreadable.append(f"{d} ({err.strerror or err})")
                continue
            for e in entries:
                p = d / e.name
                try:
                    is_dir, is_link = e.is_dir(), e.is_symlink()
                except OSError:
                    is_dir, is_link = False, False
                if is_dir and is_link:
                    links.append((sdir, p))
                elif is_dir:
                    if claim(p):
                        stack.append(p)
                elif e.is_file():
                    out[sdir].append(p)
                elif is_link and not p.exists():
                    dangling.append(str(p))

    for sdir in sorted(src_dirs, key=lambda d: d.is_symlink()):  # a real source folder wins over a link to it
        if claim(sdir):
            out[sdir] = []
    out = {sdir: out[sdir] for sdir in src_dirs if sdir in out}
    for sdir in out:
        walk(sdir, sdir)
    i = 0
    while i < len(links):  # links met inside linked folders are appended and followed in turn
        sdir, link = links[i]
        i += 1
        if claim(link):
            walk(sdir, link)
    if loops:
        _note(f"{len(loops)} link(s) lead to a folder above them and are not followed (they would loop): "
              f"{loops[:5]}")
    if again:
        _note(f"{len(again)} folder(s) lead to a folder already read under another path and are not read "
              f"twice: {again[:5]}")
    if dangling:
        _note(f"{len(dangling)} link(s) lead nowhere and are not read: {dangling[:5]}")
    if unreadable:
        _note(f"{len(unreadable)} folder(s) cannot be listed and are not read: {unreadable[:5]}")
    return _read_files_once(out)


def _read_files_once(out: dict[Path, list[Path]]) -> dict[Path, list[Path]]:
    """``out`` with each real file kept once (a link to a file, or a hard link, is a second path to
    it): files reached without a link to the file first, in walk order, then links in sorted order;
    the paths dropped are named on stderr, as a second path to a folder is."""
    every = [(sdir, f) for sdir, files in out.items() for f in files]
    linked = [f.is_symlink() for _, f in every]
    order = ([i for i in range(len(every)) if not linked[i]]
             + sorted((i for i in range(len(every)) if linked[i]), key=lambda i: str(every[i][1])))
    first: dict[tuple[int, int], Path] = {}
    dropped: set[int] = set()
    again: list[str] = []
    for i in order:
        f = every[i][1]
        try:
            st = f.stat()
        except OSError:
            continue  # read (and reported) as it is
        key = (st.st_dev, st.st_ino)
        if key in first:
            dropped.add(i)
            again.append(f"{f} -> {first[key]}")
        else:
            first[key] = f
    if again:
        _note(f"{len(again)} file(s) are a second path to a file already read and are not read twice: "
              f"{again[:5]}")
    kept: dict[Path, list[Path]] = {sdir: [] for sdir in out}
    for i, (sdir, f) in enumerate(every):
        if i not in dropped:
            kept[sdir].append(f)
    return kept


def part_dirname(part: str) -> str:
    """Flat directory name of a partition (``src/1-1/0_1`` -> ``src__1-1__0_1``)."""
    return part.replace("/", "__")


def read_jsonl(path: Path) -> Iterator[tuple[int, str]]:
    """``(line_number, text)`` of each record; malformed records raise naming ``path:line``."""
    gz = path.name.endswith(".gz")
    opener: Any = gzip.open if gz else open
    try:
        if gz and path.stat().st_size == 0:  # gzip reads it as empty; a gzip of nothing is 20 bytes
            raise DataError(f"{path}: empty (0 bytes), not a gzip file (an interrupted download?)")
        with opener(path, "rt", encoding="utf-8", newline="\n") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as err:
                    if lineno == 1 and line.encode("utf-8", "replace").startswith(LFS_POINTER):
                        raise DataError(_lfs_pointer(path)) from None
                    what = err.msg[:-3] if err.msg.endswith(" at") else err.msg  # "Invalid control character at"
                    raise DataError(f"{path}:{lineno}: invalid JSON ({what} at column {err.colno})") from None
                if not isinstance(rec, dict):
                    raise DataError(f"{path}:{lineno}: record is a JSON {_json_kind(rec)}, not an object "
                                    "with a 'text' field")
                if "text" not in rec:
                    raise DataError(f"{path}:{lineno}: record has no 'text' field")
                if not isinstance(rec["text"], str):
                    raise DataError(f"{path}:{lineno}: 'text' is a JSON {_json_kind(rec['text'])}, "
                                    "expected a string")
                if _SURROGATE_ESCAPE.search(line):  # only a JSON escape can make a lone surrogate
                    try:
                        rec["text"].encode("utf-8")
                    except UnicodeEncodeError as err:
                        raise DataError(f"{path}:{lineno}: 'text' is not valid Unicode ({err.reason} at "
                                        f"character {err.start})") from None
                yield lineno, rec["text"]
    except UnicodeDecodeError as err:
        if not gz and _head(path) == GZIP_MAGIC:
            raise DataError(f"{path}: looks gzip-compressed (it starts with the gzip bytes 1f 8b) but is named "
                            f"{path.suffix}; rename it to {path.name}.gz") from None
        raise DataError(_not_utf8(path, err)) from None
    except gzip.BadGzipFile as err:
        head = _head(path)
        if _head(path, len(LFS_POINTER)) == LFS_POINTER:
            raise DataError(_lfs_pointer(path)) from None
        if head != GZIP_MAGIC and head is not None:
            raise DataError(f"{path}: named .gz but not gzip-compressed (it starts with {head!r}); rename it to "
                            f"{path.name[:-3]}") from None
        raise DataError(f"{path}: cannot read ({err})") from None
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"{path}: cannot read ({err})") from None


GZIP_MAGIC = b"\x1f\x8b"


def _lfs_pointer(path: Path) -> str:
    return (f"{path}: a Git LFS pointer, not the data (a clone without git-lfs, or GIT_LFS_SKIP_SMUDGE=1): "
            "fetch the files with `git lfs pull`")


def _head(path: Path, n: int = 2) -> bytes | None:
    """The first ``n`` bytes of ``path`` (None: unreadable)."""
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError:
        return None


def _json_kind(value: Any) -> str:
    """JSON's name for the type of a decoded value (``array``, ``string``, ...)."""
    if value is None:
        return "null"
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(
        type(value), type(value).__name__)


def _not_utf8(path: Path, err: UnicodeDecodeError) -> str:
    """The error for bytes of ``path`` that are not UTF-8: ``path:LINE: not UTF-8: byte 0xe9 at
    byte N of the line (reason)``, found by re-reading the file (gz: decompressed) line by line."""
    opener: Any = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as bad:
                    return (f"{path}:{lineno}: not UTF-8: byte 0x{bad.object[bad.start]:02x} at byte {bad.start + 1} "
                            f"of the line ({bad.reason})")
    except (OSError, EOFError, zlib.error):
        pass
    return f"{path}: not UTF-8: byte 0x{err.object[err.start]:02x} ({err.reason}; line not found)"


def _hash01(text: str, key: bytes) -> float:
    """Keyed 64-bit BLAKE2b of ``text`` mapped to [0, 1)."""
    digest = hashlib.blake2b(text.encode("utf-8"), key=key, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


@dataclass(frozen=True)
class HoldoutSpec:
    """Content-hash bands for the validation and LR-screen sets (fractions of documents)."""

    val_fraction: float = 0.002
    screen_fraction: float = 0.001
    salt: str = "megaloop-holdout-v1"

    def __post_init__(self) -> None:
        for name in ("val_fraction", "screen_fraction"):
            v = getattr(self, name)
            if not (0.0 <= v < 1.0):
                raise DataError(f"holdout {name} must be in [0, 1), got {v}")
        if self.val_fraction + self.screen_fraction >= 1.0:
            raise DataError("holdout val_fraction + screen_fraction must be < 1")

    def band(self, text: str) -> str:
        """``"val"``, ``"screen"`` or ``"train"`` for a document."""
        if self.val_fraction + self.screen_fraction == 0.0:
            return "train"
        u = _hash01(text, self.salt.encode()[:64])
        if u < self.val_fraction:
            return "val"
        if u < self.val_fraction + self.screen_fraction:
            return "screen"
        return "train"

    def to_dict(self) -> dict:
        return {"val_fraction": self.val_fraction, "screen_fraction": self.screen_fraction,
                "salt": self.salt}


def doc_rank_key(text: str, seed: int) -> float:
    """Seeded content hash used to pick which documents get a fractional extra copy."""
    return _hash01(text, f"megaloop-upsample-{seed}".encode())


def copies_per_doc(keys: np.ndarray, multiplier: float) -> np.ndarray:
    """Copies of each document: ``floor(m)``, plus one for each document whose seeded content key
    (uniform in [0, 1)) is below ``frac(m)``: every document's expected count is ``m`` whatever
    file holds it, and the choice does not depend on how documents are grouped into files. (It
    was ``round(frac(m)·n)`` extra copies per file of n documents: a one-document file at m = 0.4
    got none, so a source of small files vanished from the mix, and m = 1.5 gave one copy.)"""
    base = math.floor(multiplier)
    return np.full(len(keys), base, dtype=np.int64) + (np.asarray(keys) < multiplier - base)


def _parse_pairs(text: str, what: str) -> dict[str, float]:
    """``"a=1,b=2.5"`` -> ``{"a": 1.0, "b": 2.5}``."""
    out: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise DataError(f"{what}: expected name=weight, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = float(v)
        except ValueError:
            raise DataError(f"{what}: weight of {k.strip()!r} is not a number: {v!r}") from None
    return out


@dataclass(frozen=True)
class MixSpec:
    """Per-source weights times per-bucket upsampling factors (unlisted source: weight 1)."""

    source_weights: Mapping[str, float] = field(default_factory=dict)
    bucket_upsample: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_BUCKET_UPSAMPLE))

    def __post_init__(self) -> None:
        for where, table in (("source weight", self.source_weights),
                             ("bucket upsample", self.bucket_upsample)):
            for k, v in table.items():
                if not (math.isfinite(v) and v >= 0):
                    raise DataError(f"{where} of {k!r} must be a finite number >= 0, got {v}")
        unknown = set(self.bucket_upsample) - set(BUCKETS) - {NO_BUCKET}
        if unknown:
            raise DataError(f"unknown bucket(s) {sorted(unknown)}; buckets are "
                            f"{list(BUCKETS) + [NO_BUCKET]}")

    def multiplier(self, source: str, bucket: str) -> float:
        """Expected copies per document of (source, bucket)."""
        up = self.bucket_upsample.get(bucket, DEFAULT_BUCKET_UPSAMPLE.get(bucket, 1.0))
        return float(self.source_weights.get(source, 1.0)) * float(up)

    def check_sources(self, known: list[str]) -> None:
        """Error if a weight names a source that is not in the input tree."""
        bad = sorted(set(self.source_weights) - set(known))
        if bad:
            raise DataError(f"source weight(s) for {bad}, but the input has sources {sorted(known)}")

    def to_dict(self) -> dict:
        buckets = dict(DEFAULT_BUCKET_UPSAMPLE)
        buckets.update(self.bucket_upsample)
        return {"source_weights": dict(sorted(self.source_weights.items())),
                "bucket_upsample": buckets}

    @classmethod
    def from_args(cls, weights_file: str | None = None, source_weights: str | None = None,
                  bucket_upsample: str | None = None) -> "MixSpec":
        """From a YAML/JSON file (keys ``source_weights``, ``bucket_upsample``) and/or CLI pairs."""
        sw: dict[str, float] = {}
        bu: dict[str, float] = dict(DEFAULT_BUCKET_UPSAMPLE)
        if weights_file:
            path = Path(weights_file)
            if not path.is_file():
                raise DataError(f"weights file {path} does not exist")
            import yaml

            try:
                data = yaml.safe_load(path.read_text()) or {}
            except yaml.YAMLError as err:  # one line with the place, as --config says it
                from megaloop.config_utils import yaml_error_text

                raise DataError(f"weights file {path}: {yaml_error_text(err)}") from None
            except UnicodeDecodeError as err:
                raise DataError(f"weights file {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
            if not isinstance(data, dict) or set(data) - {"source_weights", "bucket_upsample"}:
                raise DataError(f"weights file {path}: expected a mapping with keys "
                                "source_weights and/or bucket_upsample")
            for key, table in (("source_weights", sw), ("bucket_upsample", bu)):
                given = data.get(key) or {}
                if not isinstance(given, dict):
                    raise DataError(f"weights file {path}: {key} must be a mapping name: weight, "
                                    f"got {type(given).__name__}")
                for k, v in given.items():
                    try:
                        table[str(k)] = float(v)
                    except (TypeError, ValueError):
                        raise DataError(f"weights file {path}: {key}: weight of {str(k)!r} is not a number: "
                                        f"{v!r}") from None
        if source_weights:
            sw.update(_parse_pairs(source_weights, "--source-weights"))
        if bucket_upsample:
            bu.update(_parse_pairs(bucket_upsample, "--bucket-upsample"))
        return cls(source_weights=sw, bucket_upsample=bu)
