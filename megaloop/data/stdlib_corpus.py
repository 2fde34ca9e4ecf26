"""Documents of the embedded corpus, read from the running Python installation (no download).

Three TxT360 sources; one document is one JSONL record ``{text, meta}``:

* ``python-docs`` (prose): the reference topics of ``pydoc_data.topics`` in paragraph groups of
  at least ``TOPIC_CHARS`` characters, then one *reference page* per code chunk: the docstrings of
  the module, classes and functions defined in that chunk, extracted with ``ast`` (nothing is
  imported) and laid out as pydoc's text view does (signature line, indented docstring).
* ``python-code``: the standard library's ``.py`` files outside test directories, cut at top-level
  statement boundaries into chunks of at least ``CODE_CHARS`` characters.
* ``python-tests``: the test suites (directories ``test``, ``tests``, ``idle_test``), cut before a column-0 line
  after a blank line, into chunks of at least ``CODE_CHARS`` characters.

Walked: ``sysconfig.get_paths()["stdlib"]`` in sorted path order, without following symlinks;
skipped: ``site-packages`` / ``dist-packages``, ``__pycache__``, ``pydoc_data`` (the topics again)
and files that are not valid UTF-8 (listed by ``extract``).

Holdout hygiene: a reference page repeats text of its code chunk, so ``select`` keeps a page only
when the content-hash holdout puts it in the same band (train / val / screen) as that chunk;
otherwise held-out text would also be trained on.

Duplicate buckets: TxT360 groups documents by how often they recur across crawls; this corpus has
no crawls, so each document gets a pseudo bucket from its content hash (about 60 % ``1-1``, 30 %
``2-5``, 10 % ``6-10``), which exercises the upsampling path.
"""

from __future__ import annotations

import ast
import bisect
import functools
import hashlib
import json
import os
import platform
import re
import sysconfig
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from megaloop.data.txt360 import HoldoutSpec

CORPUS_VERSION = 2
SOURCES = ("python-code", "python-docs", "python-tests")
TOPIC_CHARS = 1200  # topic paragraphs are grouped into documents of at least this many characters
CODE_CHARS = 4000  # code files are cut into chunks of at least this many characters
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "pydoc_data"})
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$")  # the line breaks ``ast`` counts


@dataclass(frozen=True)
class SourceFile:
    """One ``.py`` file of the standard library; ``rel`` is its posix path below the stdlib root."""

    rel: str
    path: Path
    source: str  # "python-code" or "python-tests"


@dataclass(frozen=True)
class Document:
    """One corpus document; ``parent`` is the code chunk a reference page documents (or None)."""

    source: str
    bucket: str
    text: str
    meta: dict = field(hash=False)
    parent: str | None = field(default=None, repr=False)

    def as_record(self) -> dict:
        """``{source, bucket, text, meta}`` (the public dict form)."""
        return {"source": self.source, "bucket": self.bucket, "text": self.text, "meta": self.meta}


@dataclass(frozen=True)
class Extraction:
    """Every document of the installation, before holdout selection, plus what was skipped."""

    documents: tuple[Document, ...]
    skipped_undecodable: tuple[str, ...]  # rel paths of files that are not valid UTF-8
    unparsed: tuple[str, ...]  # python-code files ``ast`` rejects (chunked by blank lines, no page)


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[SourceFile]:
    """The ``.py`` files of the standard library, sorted by relative path (see module doc)."""
    root = root or stdlib_root()
    out: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        rel_dir = Path(dirpath).relative_to(root)
        source = "python-tests" if TEST_DIRS & set(rel_dir.parts) else "python-code"
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if name.endswith(".py") and path.is_file() and not path.is_symlink():
                out.append(SourceFile((rel_dir / name).as_posix(), path, source))
    return sorted(out, key=lambda f: f.rel)


def _topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return dict(sorted(topics.items()))


def pseudo_bucket(text: str) -> tuple[str, int]:
    """``(bucket, dup_count)`` of a document from its content hash (deterministic)."""
    h = int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 16**8
    return ("1-1", 1) if h < 0.6 else ("2-5", 3) if h < 0.9 else ("6-10", 8)


@functools.lru_cache(maxsize=2)
def corpus_fingerprint(root: Path | None = None) -> str:
    """SHA-256 of everything the corpus is made of: settings, Python version, file list, bytes."""
    h = hashlib.sha256(json.dumps({
        "v": CORPUS_VERSION, "python": platform.python_version(), "topic_chars": TOPIC_CHARS,
        "code_chars": CODE_CHARS, "skip": sorted(SKIP_DIRS), "tests": sorted(TEST_DIRS)}).encode())
    for f in stdlib_files(root):
        data = f.path.read_bytes()
        h.update(f"{f.rel}\0{len(data)}\0".encode())
        h.update(data)
    h.update(json.dumps(_topics(), sort_keys=True).encode())
    return h.hexdigest()


def topic_documents() -> list[Document]:
    """``pydoc_data.topics`` as ``python-docs`` documents (paragraph groups, sorted by topic)."""
    docs = []
    for topic, text in _topics().items():
        paras = [p.strip() for p in text.split("\n\n") if p.strip()]
        group: list[str] = []
        for i, p in enumerate(paras):
            group.append(p)
            if sum(map(len, group)) >= TOPIC_CHARS or i == len(paras) - 1:
                body = "\n\n".join(group)
                bucket, dup = pseudo_bucket(body)
                docs.append(Document("python-docs", bucket, body, {
                    "origin": "pydoc_data.topics", "topic": topic, "part": len(group),
                    "dup_count": dup}))
                group = []
    return docs


def _chunk_ranges(n_lines: int, starts: list[int], min_chars: int,
                  lengths: list[int]) -> list[tuple[int, int]]:
    """Group blocks starting at line indices ``starts`` into line ranges ``[a, b)`` of at least
    ``min_chars`` characters (``lengths``: characters per line)."""
    bounds = sorted({s for s in starts if 0 < s < n_lines} | {0, n_lines})
    ranges: list[tuple[int, int]] = []
    a, size = 0, 0
    for s, e in zip(bounds, bounds[1:]):
        size += sum(lengths[s:e])
        if size >= min_chars:
            ranges.append((a, e))
            a, size = e, 0
    if a < n_lines:
        if ranges and size < min_chars // 2:
            ranges[-1] = (ranges[-1][0], n_lines)  # a short tail joins the previous chunk
        else:
            ranges.append((a, n_lines))
    return ranges


def _parse(text: str) -> ast.Module | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarning for invalid escapes in old code
        try:
            return ast.parse(text)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None


def _indent(doc: str) -> str:
    return "\n".join(("    " + line) if line else "" for line in doc.splitlines())


def _doc_entries(tree: ast.Module, module: str) -> list[tuple[int, str]]:
    """``(line, entry)`` of each docstring (module, classes, functions, methods) in pydoc layout."""
    out: list[tuple[int, str]] = []
    doc = ast.get_docstring(tree)
    if doc:
        out.append((tree.body[0].lineno, f"module {module}\n{_indent(doc)}"))

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                name = prefix + node.name
                if isinstance(node, ast.ClassDef):
                    bases = ", ".join(ast.unparse(b) for b in [*node.bases, *node.keywords])
                    head = f"class {name}({bases})" if bases else f"class {name}"
                    visit(node.body, name + ".")
                else:
                    head = f"{'async ' if isinstance(node, ast.AsyncFunctionDef) else ''}" \
                           f"def {name}({ast.unparse(node.args)})"
                if doc:
                    out.append((node.lineno, f"{head}\n{_indent(doc)}"))
            elif isinstance(node, (ast.If, ast.Try)):  # platform / import-fallback definitions
                for part in (node.body, node.orelse, getattr(node, "finalbody", []),
                             *[h.body for h in getattr(node, "handlers", [])]):
                    visit(part, prefix)

    visit(tree.body, f"{module}.")
    return sorted(out, key=lambda e: e[0])


def _module_name(rel: str) -> str:
    parts = rel[: -len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def file_documents(f: SourceFile, text: str) -> tuple[list[Document], bool]:
    """Code chunks of one file and (code files only) their reference pages; ``(docs, parsed)``."""
    lines = _LINE.findall(text)
    lengths = [len(line) for line in lines]
    tree = _parse(text) if f.source == "python-code" else None  # tests: no pages, no ast needed
    if tree is not None and tree.body:
        # A chunk may end after any top-level statement; the gap after it (blank lines, comments)
        # goes with the next statement, and no multi-line string is ever cut.
        starts = [stmt.end_lineno for stmt in tree.body[:-1] if stmt.end_lineno]
    else:  # tests, or not Python 3 syntax: cut before a column-0 line after a blank line
        starts = [i for i in range(1, len(lines))
                  if lines[i][:1] not in ("", " ", "\t", "\r", "\n") and not lines[i - 1].strip()]
    ranges = _chunk_ranges(len(lines), starts, CODE_CHARS, lengths)
    chunks = ["".join(lines[a:b]) for a, b in ranges]
    entries: list[list[str]] = [[] for _ in ranges]
    if tree is not None:
        ends = [b for _, b in ranges]
        for lineno, entry in _doc_entries(tree, _module_name(f.rel)):
            entries[bisect.bisect_right(ends, lineno - 1)].append(entry)
    docs: list[Document] = []
    for (a, b), chunk, ents in zip(ranges, chunks, entries):
        if not chunk.strip():
            continue
        bucket, dup = pseudo_bucket(chunk)
        docs.append(Document(f.source, bucket, chunk, {
            "origin": "python-stdlib", "path": f.rel, "lines": [a + 1, b], "dup_count": dup}))
        if ents:
            page = "\n\n".join(ents)
            bucket, dup = pseudo_bucket(page)
            docs.append(Document("python-docs", bucket, page, {
                "origin": "python-stdlib-docstrings", "path": f.rel, "module": _module_name(f.rel),
                "lines": [a + 1, b], "entries": len(ents), "dup_count": dup}, parent=chunk))
    return docs, tree is not None


@functools.lru_cache(maxsize=2)
def _extract_cached(root: Path | None, fingerprint: str) -> Extraction:
    docs = topic_documents()
    skipped, unparsed = [], []
    for f in stdlib_files(root):
        try:
            text = f.path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(f.rel)
            continue
        file_docs, parsed = file_documents(f, text)
        docs.extend(file_docs)
        if not parsed and f.source == "python-code":
            unparsed.append(f.rel)
    return Extraction(tuple(docs), tuple(skipped), tuple(unparsed))


def extract(root: Path | None = None) -> Extraction:
    """All documents (topics first, then files in path order), cached per corpus fingerprint."""
    return _extract_cached(root, corpus_fingerprint(root))


def select(extraction: Extraction, holdout: HoldoutSpec) -> list[Document]:
    """The corpus' documents: those of ``extraction`` minus the reference pages whose holdout
    band differs from their code chunk's."""
    return [d for d in extraction.documents
            if d.parent is None or holdout.band(d.text) == holdout.band(d.parent)]


def platform_summary() -> dict:
    """Interpreter facts recorded in provenance."""
    return {"python_version": platform.python_version(),
            "python_implementation": platform.python_implementation(),
            "stdlib": str(stdlib_root())}
