"""Tokenizer loading (HF ``tokenizer.json`` or SentencePiece ``.model``).

``load_tokenizer(path)`` accepts a ``tokenizer.json`` file, a SentencePiece ``.model`` file, a
directory holding either, or ``"default"`` (the embedded corpus' tokenizer, built on first use by
``megaloop.data.default_tokenizer``). The returned object encodes *without* adding special tokens;
the packer appends EOS itself. BPE training lives in ``megaloop.data.bpe`` (re-exported here).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Sequence

from megaloop.data.bpe import SPECIAL_TOKENS, train_bytelevel_bpe
from megaloop.data.errors import DataError

EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>")
BOS_CANDIDATES = ("<|bos|>", "<|begin_of_text|>", "<s>", "<bos>", "[BOS]")
PAD_CANDIDATES = ("<|pad|>", "<pad>", "[PAD]")
__all__ = ["SPECIAL_TOKENS", "Tokenizer", "file_sha256", "find_relative", "load_tokenizer",
           "manifest_tokenizer_sha256", "read_manifest", "train_bytelevel_bpe", "verified_manifest_tokenizer"]


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest_tokenizer_sha256(manifest: dict) -> str | None:
    """SHA-256 of the tokenizer a dataset manifest records (``tokenizer_sha256``, or the
    ``tokenizer`` entry's ``sha256``); None when it records none."""
    tok = manifest.get("tokenizer")
    return manifest.get("tokenizer_sha256") or (tok.get("sha256") if isinstance(tok, dict) else None)


def manifest_eos_id(manifest: dict) -> int | None:
    """The EOS id a dataset manifest records (``eos_id``, or the ``tokenizer`` entry's); None if none."""
    tok = manifest.get("tokenizer")
    eos = manifest.get("eos_id", tok.get("eos_id") if isinstance(tok, dict) else None)
    return eos if isinstance(eos, int) and not isinstance(eos, bool) else None


def read_manifest(folder: str | Path, name: str = "manifest.json") -> dict | None:
    """``folder/name`` as a JSON object; None when it is missing, unreadable or not an object."""
    try:
        data = json.loads((Path(folder) / name).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def find_relative(path: str | Path, base: str | Path, accept=None) -> Path | None:
    """Where a path recorded relative to an unrecorded working directory is: an absolute path is
    itself; a relative one is tried against ``base`` and its ancestors (nearest first), then the
    current directory. The first candidate that exists and that ``accept`` (when given) takes;
    None when there is none. (A run's ``data.path`` from its run directory: ``--run-dir runs/x``
    launched beside the data; a manifest's tokenizer path from the manifest's folder.)"""
    p = Path(path).expanduser()
    if p.is_absolute():
        cands = [p]
    else:
        root = Path(os.path.abspath(base))
        cands = [b / p for b in (root, *root.parents)] + [Path(os.path.abspath(p))]
    for cand in dict.fromkeys(cands):
        if cand.exists() and (accept is None or accept(cand)):
            return cand
    return None


def verified_manifest_tokenizer(folder: str | Path) -> tuple[Path | None, list[str]]:
    """``(the tokenizer file a dataset's manifest names, whose sha256 is the one it records, or None;
    why each file found under that name was not taken)``. The path is found with
    :func:`find_relative` from ``folder``; a manifest recording no sha256 vouches for no file."""
    folder = Path(folder)
    manifest = read_manifest(folder) or {}
    entry = manifest.get("tokenizer")
    name = entry.get("path") if isinstance(entry, dict) else entry if isinstance(entry, str) else None
    if not name:
        return None, []
    want = manifest_tokenizer_sha256(manifest)
    shas: dict[Path, str] = {}

    def recorded(cand: Path) -> bool:
        shas[cand] = file_sha256(cand) if cand.is_file() else "(not a file)"
        return shas[cand] == want

    found = find_relative(name, folder, recorded)
    return found, ([] if found is not None else [
        f"{cand} has sha256 {have}, but {folder / 'manifest.json'} records {want or 'no sha256'} for its "
        f"tokenizer {name}" for cand, have in shas.items()])


class Tokenizer:
    """Uniform view of an HF ``tokenizers`` or SentencePiece tokenizer.

    Attributes: ``path`` (resolved file), ``kind`` ("hf" | "sentencepiece"), ``sha256`` (of the
    file), ``vocab_size`` (incl. added tokens), ``eos_id``, ``bos_id`` / ``pad_id`` (or None).
    """

    def __init__(self, path: str | Path, eos_token: str | None = None) -> None:
        self.path = _resolve(Path(path))
        self.sha256 = file_sha256(self.path)
        self.sha256s: tuple[str, ...] = (self.sha256,)  # digests a data set's record may match
        if self.path.suffix == ".model":
            self.kind = "sentencepiece"
            self._init_sentencepiece(eos_token)
        else:
            self.kind = "hf"
            self._init_hf(eos_token)

    def _init_hf(self, eos_token: str | None) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(self.path))
        except Exception as err:  # tokenizers raises plain Exception subclasses
            raise DataError(f"cannot load tokenizer {self.path}: {err}") from None
        # a tokenizer.json that HF's save_pretrained wrote after use with padding=True (or truncation)
        # carries those settings: megaloop encodes raw ids, so they are turned off; the file then
        # differs from the one a data set recorded only by them, so its content digest is kept too
        if self._tok.padding is not None or self._tok.truncation is not None:
            self._tok.no_padding()
            self._tok.no_truncation()
            self.sha256s = (self.sha256, hashlib.sha256(self._tok.to_str(pretty=True).encode()).hexdigest())
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        cfg = _read_tokenizer_config(self.path.parent)
        eos = self._find_id(eos_token or cfg.get("eos_token"), EOS_CANDIDATES, "EOS")
        assert eos is not None  # _find_id raises when a required token is missing
        self.eos_id: int = eos
        self.bos_id = self._find_id(cfg.get("bos_token"), BOS_CANDIDATES, None)
        self.pad_id = self._find_id(cfg.get("pad_token"), PAD_CANDIDATES, None)

    def _find_id(self, explicit: str | None, candidates: Sequence[str], need: str | None) -> int | None:
        names = [explicit] if explicit else list(candidates)
        for name in names:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return int(tid)
        if need:
            raise DataError(f"tokenizer {self.path}: no {need} token found (tried {names}); "
                            f"pass --eos-token or add eos_token to tokenizer_config.json")
        return None

    def _init_sentencepiece(self, eos_token: str | None) -> None:
        try:
            import sentencepiece as spm
        except ImportError:
            raise DataError(f"tokenizer {self.path} is a SentencePiece model but the "
                            "`sentencepiece` package is not installed (pip install sentencepiece)"
                            ) from None
        self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        self.vocab_size = int(self._sp.get_piece_size())
        eos = self._sp.piece_to_id(eos_token) if eos_token else self._sp.eos_id()
        if eos is None or eos < 0:
            raise DataError(f"tokenizer {self.path}: SentencePiece model has no EOS id")
        self.eos_id = int(eos)
        self.bos_id = int(self._sp.bos_id()) if self._sp.bos_id() >= 0 else None
        self.pad_id = int(self._sp.pad_id()) if self._sp.pad_id() >= 0 else None

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the tokenizer's special tokens (HF: added tokens marked special; SentencePiece: its
        control tokens) with EOS/BOS/pad: tokens no document's text is made of."""
        ids = {i for i in (self.eos_id, self.bos_id, self.pad_id) if i is not None}
        if self.kind == "hf":
            ids |= {int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        else:
            ids |= {i for i in range(self._sp.get_piece_size()) if self._sp.is_control(i)}
        return frozenset(ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        if self.kind == "sentencepiece":
            return list(self._sp.encode(text))
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str], *, specials_as_text: bool = True) -> list[list[int]]:
        """Token ids of each document (no special tokens added). ``specials_as_text``: a special
        token's string inside a document (``<|endoftext|>`` quoted in code or a crawled page) is
        tokenised as text, as every other string is, not turned into the special id: an EOS id
        there would end a document mid-text (and ``data.mask_document_boundaries`` mask the token
        after it). The data pipeline's documents are encoded this way."""
        if self.kind == "sentencepiece":  # control symbols are never matched in text
            return [list(x) for x in self._sp.encode(list(texts))]
        tok = self._document_tokenizer() if specials_as_text else self._tok
        # encode_batch_fast: the same ids without offsets (about half the time and 17 % less memory on a
        # 5M-character document; tokenizers >= 0.21)
        encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def _document_tokenizer(self):
        """A second instance of the HF tokenizer that reads special tokens' strings as text (its own
        object: ``encode`` on another thread keeps matching them, as prompts expect)."""
        doc = getattr(self, "_doc_tok", None)
        if doc is None:
            from tokenizers import Tokenizer as HFTokenizer

            doc = HFTokenizer.from_str(self._tok.to_str())
            doc.encode_special_tokens = True
            self._doc_tok = doc
        return doc

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (special tokens kept, so EOS shows as its string)."""
        ids = [int(i) for i in ids]
        if self.kind == "sentencepiece":
            return self._sp.decode(ids)
        return self._tok.decode(ids, skip_special_tokens=False)

    def describe(self) -> dict:
        """JSON-able summary for manifests."""
        return {"path": str(self.path), "kind": self.kind, "sha256": self.sha256,
                "vocab_size": self.vocab_size, "eos_id": self.eos_id, "bos_id": self.bos_id,
                "pad_id": self.pad_id}


def _resolve(path: Path) -> Path:
    """File behind a tokenizer path (file, or directory with tokenizer.json / tokenizer.model)."""
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (path / name).is_file():
                return path / name
        models = sorted(path.glob("*.model"))
        if models:
            return models[0]
        raise DataError(f"tokenizer directory {path} holds no tokenizer.json or *.model")
    if not path.is_file():
        raise DataError(f"tokenizer {path} does not exist")
    return path


def _read_tokenizer_config(directory: Path) -> dict:
    """``{eos_token, bos_token, pad_token}`` strings from an HF tokenizer_config.json, if any."""
    out: dict = {}
    cfg = directory / "tokenizer_config.json"
    if cfg.is_file():
        try:
            data = json.loads(cfg.read_text())
        except json.JSONDecodeError as err:
            raise DataError(f"{cfg}: invalid JSON ({err})") from None
        for key in ("eos_token", "bos_token", "pad_token"):
            val = data.get(key)
            if isinstance(val, dict):
                val = val.get("content")
            if isinstance(val, str):
                out[key] = val
    return out


def load_tokenizer(path: str | Path, eos_token: str | None = None) -> Tokenizer:
    """Load a tokenizer; ``"default"`` gives the embedded corpus' byte-level BPE tokenizer."""
    if str(path) == "default":
        from megaloop.data.default_tokenizer import ensure_default_tokenizer

        path = ensure_default_tokenizer()
    return Tokenizer(path, eos_token=eos_token)
