"""A depth-hungry synthetic source: straight-line Python programs over Z_m (issue #20).

Every document is one program. ``n_vars`` variables get constants, then one target variable is
updated ``k`` times (``x+=c``, ``x-=c``, ``x*=c``, or ``x+=y`` with another variable; other
variables may be reassigned between updates), then ``print(x%m)`` and the printed value::

    x=3
    x+=4#2
    x*=2#?
    print(x%5)
    4

The text is valid Python and prints its last line (``%`` commutes with ``+ - *``, so the value is
computed step by step in Z_m). The value of ``x`` after update ``j`` depends on update ``j-1``:
answering needs a k-step chain. Every program is filtered so that each of its ``k`` updates
matters (dropping any one changes the answer: no ``x*=1``, no ``x*=c`` at ``x≡0``).

Dense supervision (``scratch``, ``scratch_lines``, ``mark_hidden``): that share of the *training*
documents shows intermediate values as comments (``x+=4#0``), each update with probability
``scratch_lines``; with ``mark_hidden`` the other updates carry ``#?``. Hidden runs between shown
values must be computed internally, so the model learns to carry the chain; held-out problems show
no value (every update ``#?`` with ``mark_hidden``).

Held-out problems (``heldout_problems``) come from their own random stream; a training program
that *begins* with a held-out program (the same lines up to one of its target updates, whose
comment would show that held-out answer) is redrawn at the same k, so no held-out answer is
trained on and k stays uniform (``GENERATOR`` 2; generator 1 skipped whole-program matches only and
redrew k: with the defaults, training programs showed the answers of 50/48/19 of the 50 held-out
problems at k = 1/2/3, and k = 1 was ~8 % short).
Determinism: document ``i`` of file ``f`` depends only on (seed, f, i) through
``random.Random("megaloop-synth:<seed>:<stream>:<f>")`` (string seeds hash with SHA-512: the same
bytes on every platform and Python 3 version).

Layout written by :func:`write_synth_tree` (the TxT360 layout ``data_prep/txt360_to_mds.py``
reads)::

    ROOT/data/synth-programs/1-1/<i>_<n>.jsonl   {"text", "meta": {"k", "answer", "scratch", ...}}
    ROOT/heldout.jsonl                          {"id", "k", "prompt", "target", "answer", ...}
    ROOT/tokenizer/tokenizer.json               character-level (byte BPE without merges)
    ROOT/synth.json                             settings and counts (written last)
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from megaloop.config_utils import ConfigError, require
from megaloop.runtime.files import atomic_write_text

SOURCE = "synth-programs"
BUCKET = "1-1"
VAR_POOL = "abcdefghijkmnpqrstuvwxyz"  # single-letter names (no l, o: they read as 1, 0)
OPS = "+-*"
HELDOUT_SEED = 20  # seed of the shipped held-out set (megaloop/eval/tasks/megaloop_synth.jsonl)
HELDOUT_KS = tuple(range(1, 9))
HELDOUT_PER_K = 50
TRAIN_STREAM, HELDOUT_STREAM = "train", "heldout"
GENERATOR = 2  # synth.json's "generator": what a tree's training programs exclude (module docstring)
CHAR_VOCAB = 259  # 256 byte symbols + 3 specials: a byte-level BPE with no merges = characters
_LINE = re.compile(r"^([a-z])([+\-*]?)=([a-z]|\d+)(?:#(?:\d+|\?))?$")


@dataclass(frozen=True)
class SynthConfig:
    """Settings of the program family (all validated; errors name the ``synth.`` field).

    modulus: m, values live in Z_m (``print(x%m)``); k_min..k_max: updates of the target per
    training program (uniform); n_vars: variables per program (1 = a running computation);
    ops: update operators from ``+-*``; var_operand: probability that an update reads another
    variable (n_vars > 1); reassign: probability of a distractor reassignment before each update
    (n_vars > 1); scratch: share of training documents with intermediate values as comments;
    scratch_lines: in such a document, the probability that each update shows its value (1.0: all;
    below 1 the hidden runs between shown values must be computed internally, a chain whose value
    is supervised at the next shown comment or the answer); mark_hidden: every update carries a
    comment, its value where shown and ``#?`` where hidden (held-out prompts: ``#?`` on every update),
    so the position where a value is computed is the same on every line.
    """

    # defaults: the regime where depth was found to matter (README "A depth-hungry synthetic task")
    modulus: int = 5
    k_min: int = 1
    k_max: int = 6
    n_vars: int = 1
    ops: str = "+*"
    var_operand: float = 0.3
    reassign: float = 0.3
    scratch: float = 1.0
    scratch_lines: float = 0.5
    mark_hidden: bool = True

    def __post_init__(self) -> None:
        require(2 <= self.modulus <= 1000, "synth.modulus", f"must be in [2, 1000], got {self.modulus}")
        require(1 <= self.k_min <= self.k_max, "synth.k_min",
                f"need 1 <= k_min <= k_max, got k_min={self.k_min}, k_max={self.k_max}")
        require(self.k_max <= 64, "synth.k_max", f"must be <= 64, got {self.k_max}")
        require(1 <= self.n_vars <= len(VAR_POOL), "synth.n_vars",
                f"must be in [1, {len(VAR_POOL)}], got {self.n_vars}")
        require(isinstance(self.mark_hidden, bool), "synth.mark_hidden", f"must be true or false, got {self.mark_hidden!r}")
        require(bool(self.ops) and set(self.ops) <= set(OPS) and len(set(self.ops)) == len(self.ops),
                "synth.ops", f"distinct operators from {OPS!r}, got {self.ops!r}")
        require("*" not in self.ops or self.modulus > 2, "synth.ops",
                "'*' needs modulus > 2 (in Z_2 only x*=1 keeps information, and it changes nothing)")
        for name in ("var_operand", "reassign", "scratch", "scratch_lines"):
            v = getattr(self, name)
            require(0.0 <= v <= 1.0, f"synth.{name}", f"must be in [0, 1], got {v}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Problem:
    """One program. ``lines``: assignments and updates (no print); ``updates``: indices of the
    target's updates in ``lines``; ``values``: the target's value (mod m) after each update."""

    k: int
    var: str
    modulus: int
    lines: tuple[str, ...]
    updates: tuple[int, ...]
    values: tuple[int, ...]
    answer: int
    mark_hidden: bool = False  # hidden updates carry a ``#?`` comment

    @property
    def prompt(self) -> str:
        """The program up to and including ``print(x%m)`` and its newline (what the model reads)."""
        return self.text(False)[:-len(self.target)]

    @property
    def target(self) -> str:
        """The scored continuation: the printed value and the newline that ends it."""
        return f"{self.answer}\n"

    def text(self, scratch: bool | Sequence[bool] = False) -> str:
        """The document: the program (intermediate values as ``#v`` comments with ``scratch``:
        True for every update, or one flag per update), the print statement and the printed value."""
        lines = list(self.lines)
        shown = [bool(scratch)] * len(self.updates) if isinstance(scratch, bool) else list(scratch)
        require(len(shown) == len(self.updates), "scratch", f"{len(shown)} flags for {len(self.updates)} updates")
        for i, v, show in zip(self.updates, self.values, shown):
            if show or self.mark_hidden:
                lines[i] = f"{lines[i]}#{v if show else '?'}"
        return "\n".join(lines) + f"\nprint({self.var}%{self.modulus})\n{self.target}"

    def record(self, pid: str) -> dict:
        """Held-out JSONL record (the lm-eval task's and :mod:`megaloop.eval.synth`'s input)."""
        return {"id": pid, "k": self.k, "prompt": self.prompt, "target": self.target,
                "answer": self.answer, "modulus": self.modulus, "text": self.text()}


def run_program(lines: Sequence[str], modulus: int) -> dict[str, int]:
    """Execute straight-line ``lines`` (``v=c``, ``v+=c``, ``v-=u``, ``v*=c``, optional ``#..``
    comments) in Z_m; returns every variable's final value. ValueError on any other line."""
    env: dict[str, int] = {}
    for line in lines:
        m = _LINE.match(line)
        if m is None:
            raise ValueError(f"not a straight-line statement: {line!r}")
        var, op, rhs = m.groups()
        val = env[rhs] if rhs.isalpha() else int(rhs)
        if not op:
            env[var] = val % modulus
        else:
            cur = env[var]
            env[var] = (cur + val if op == "+" else cur - val if op == "-" else cur * val) % modulus
    return env


def every_update_matters(p: Problem) -> bool:
    """True when dropping any single update of the target changes the printed value."""
    for j in p.updates:
        rest = [line for i, line in enumerate(p.lines) if i != j]
        if run_program(rest, p.modulus)[p.var] == p.answer:
            return False
    return True


def _draw(rng: random.Random, k: int, cfg: SynthConfig) -> Problem:
    m = cfg.modulus
    names = rng.sample(VAR_POOL, cfg.n_vars)
    var, others = names[0], names[1:]
    env = {v: rng.randrange(m) for v in names}
    order = names[:]
    rng.shuffle(order)
    lines = [f"{v}={env[v]}" for v in order]
    updates, values = [], []
    for _ in range(k):
        if others and rng.random() < cfg.reassign:
            d = rng.choice(others)
            env[d] = rng.randrange(m)
            lines.append(f"{d}={env[d]}")
        op = rng.choice(cfg.ops)
        if others and rng.random() < cfg.var_operand:
            rhs = rng.choice(others)
            val = env[rhs]
        else:
            val = rng.randrange(2 if op == "*" else 1, m)
            rhs = str(val)
        cur = env[var]
        env[var] = (cur + val if op == "+" else cur - val if op == "-" else cur * val) % m
        updates.append(len(lines))
        values.append(env[var])
        lines.append(f"{var}{op}={rhs}")
    return Problem(k=k, var=var, modulus=m, lines=tuple(lines), updates=tuple(updates),
                   values=tuple(values), answer=env[var], mark_hidden=cfg.mark_hidden)


def draw_problem(rng: random.Random, k: int, cfg: SynthConfig, max_tries: int = 1000) -> Problem:
    """A random program with ``k`` target updates, every one of which matters (rejection sampling)."""
    require(k >= 1, "k", f"must be >= 1, got {k}")
    for _ in range(max_tries):
        p = _draw(rng, k, cfg)
        if every_update_matters(p):
            return p
    raise ConfigError(f"synth: no program with k={k} where every update matters in {max_tries} draws "
                      f"({cfg}); widen synth.ops or synth.modulus")


def _rng(seed: int, stream: str, index: int) -> random.Random:
    return random.Random(f"megaloop-synth:{seed}:{stream}:{index}")


def heldout_problems(cfg: SynthConfig, ks: Iterable[int] = HELDOUT_KS, per_k: int = HELDOUT_PER_K,
                     seed: int = HELDOUT_SEED) -> list[Problem]:
    """``per_k`` distinct held-out programs for each k in ``ks`` (no scratch), k ascending."""
    ks = sorted(set(int(k) for k in ks))
    require(bool(ks) and ks[0] >= 1, "eval k", f"need k >= 1, got {ks}")
    require(per_k >= 1, "eval per_k", f"must be >= 1, got {per_k}")
    out: list[Problem] = []
    for k in ks:
        rng, seen = _rng(seed, HELDOUT_STREAM, k), set()
        for _ in range(per_k * 100):
            if len(seen) == per_k:
                break
            p = draw_problem(rng, k, cfg)
            if p.prompt not in seen:
                seen.add(p.prompt)
                out.append(p)
        else:
            raise ConfigError(f"synth: only {len(seen)} distinct k={k} programs found, {per_k} asked; "
                              "lower the held-out count or widen the family")
    return out


def heldout_records(problems: Sequence[Problem]) -> list[dict]:
    """JSONL records with ids ``k<k>-<n>``."""
    counts: dict[int, int] = {}
    out = []
    for p in problems:
        n = counts[p.k] = counts.get(p.k, 0) + 1
        out.append(p.record(f"k{p.k}-{n - 1}"))
    return out


def tree_generator(info: dict) -> int:
    """The generator of a tree from its ``synth.json`` (1: written before ``generator`` was recorded)."""
    return int(info.get("generator") or 1)


def prefix_prompts(p: Problem) -> list[str]:
    """The held-out-style prompts of ``p`` cut after each of its target updates (j = 1..k): a
    held-out program equal to one of them has its answer at update j of ``p``."""
    return [Problem(k=j, var=p.var, modulus=p.modulus, lines=p.lines[:p.updates[j - 1] + 1],
                    updates=p.updates[:j], values=p.values[:j], answer=p.values[j - 1],
                    mark_hidden=p.mark_hidden).prompt for j in range(1, p.k + 1)]


def training_documents(cfg: SynthConfig, file_index: int, num_docs: int, *, seed: int,
                       exclude: frozenset[str] | set[str] = frozenset(), max_redraws: int = 10_000) -> Iterator[dict]:
    """``num_docs`` TxT360 records ``{"text", "meta"}`` of file ``file_index`` (k uniform in
    k_min..k_max, scratch with probability ``cfg.scratch``); a program that begins with a prompt
    in ``exclude`` (the held-out prompts; :func:`prefix_prompts`) is redrawn at the same k."""
    rng = _rng(seed, TRAIN_STREAM, file_index)
    for _ in range(num_docs):
        k = rng.randint(cfg.k_min, cfg.k_max)
        for _tries in range(max_redraws):
            p = draw_problem(rng, k, cfg)
            scratch = rng.random() < cfg.scratch
            shown = [rng.random() < cfg.scratch_lines for _ in p.updates] if scratch and cfg.scratch_lines < 1.0 \
                else scratch
            if not exclude or exclude.isdisjoint(prefix_prompts(p)):
                break
        else:
            raise ConfigError(f"synth: {max_redraws} k={k} training programs in a row begin with a held-out program; "
                              "widen the family (synth.modulus, synth.ops, synth.n_vars) or hold out fewer problems")
        yield {"text": p.text(shown), "meta": {"k": p.k, "answer": p.answer, "scratch": scratch,
                                                 "modulus": p.modulus, "n_vars": cfg.n_vars}}


@dataclass
class TreeSpec:
    """What :func:`write_synth_tree` writes: ``num_docs`` training programs in ``num_files``
    files, held-out ``eval_per_k`` programs per k in ``eval_ks`` (seed ``eval_seed``)."""

    num_docs: int = 200_000
    num_files: int = 4
    seed: int = 1234
    eval_ks: tuple[int, ...] = HELDOUT_KS
    eval_per_k: int = HELDOUT_PER_K
    eval_seed: int = HELDOUT_SEED
    synth: SynthConfig = field(default_factory=SynthConfig)

    def __post_init__(self) -> None:
        require(self.num_docs >= 1, "num_docs", f"must be >= 1, got {self.num_docs}")
        require(1 <= self.num_files <= self.num_docs, "num_files",
                f"must be in [1, num_docs={self.num_docs}], got {self.num_files}")
        self.eval_ks = tuple(sorted(set(int(k) for k in self.eval_ks)))
        require(bool(self.eval_ks) and self.eval_ks[0] >= 1, "eval_ks", f"need k >= 1, got {self.eval_ks}")


def write_char_tokenizer(out_dir: str | Path) -> Path:
    """A character-level HF tokenizer: byte-level BPE with no merges (259 ids: 3 specials, then
    the 256 byte symbols). Returns its ``tokenizer.json``."""
    from megaloop.data.bpe import train_bytelevel_bpe

    return train_bytelevel_bpe(iter(()), out_dir, vocab_size=CHAR_VOCAB)


def write_synth_tree(root: str | Path, spec: TreeSpec, *, tokenizer: bool = True,
                     add_sources: Callable[[Path], list[str]] | None = None) -> dict:
    """Write the TxT360 tree, ``heldout.jsonl``, the character tokenizer and ``synth.json``
    (last, atomically: a tree without it is unfinished). ``add_sources(root)`` puts other sources
    into ``root/data`` before that and returns their names (``linked_sources``). Returns the
    ``synth.json`` content. ``root`` must not hold another synth tree. A run that fails or is
    interrupted (Ctrl-C) removes what it wrote, so ``root`` is as it was and the same command runs
    again (an unfinished tree was left, which the converter read and a rerun refused)."""
    from megaloop.data._fsutil import first_missing

    root = Path(root)
    src_dir = root / "data" / SOURCE / BUCKET
    created = first_missing(src_dir)  # folders this run creates: everything below them is its own
    ours = [root / n for n in ("heldout.jsonl", "tokenizer", "synth.json") if not (root / n).exists()]
    data_before = set((root / "data").iterdir()) if (root / "data").is_dir() else set()
    src_was_empty = src_dir.is_dir() and not any(src_dir.iterdir())
    try:
        return _write_synth_tree(root, spec, tokenizer, add_sources)
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        if src_was_empty:
            for f in src_dir.iterdir():
                f.unlink()
        if (root / "data").is_dir():  # sources add_sources linked in
            ours += [p for p in (root / "data").iterdir() if p not in data_before]
        for p in ours:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists() or p.is_symlink():
                p.unlink()
        raise


def _write_synth_tree(root: Path, spec: TreeSpec, tokenizer: bool,
                      add_sources: Callable[[Path], list[str]] | None) -> dict:
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--out: {root} exists and is not a directory")
    src_dir = root / "data" / SOURCE / BUCKET
    if src_dir.exists() and any(src_dir.iterdir()):
        raise ConfigError(f"--out: {src_dir} already holds files; write to a fresh directory")
    taken = [n for n in ("heldout.jsonl", "synth.json", "tokenizer") if (root / n).exists()]
    if taken:
        raise ConfigError(f"--out: {root} already holds {taken}; write to a fresh directory")
    held = heldout_problems(spec.synth, spec.eval_ks, spec.eval_per_k, spec.eval_seed)  # its refusals first
    try:
        src_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file on the way, /proc, no permission: it was a traceback
        raise ConfigError(f"--out: {root}: cannot create {src_dir} ({err.strerror or err})") from None
    exclude = frozenset(p.prompt for p in held)
    per_file = [spec.num_docs // spec.num_files + (i < spec.num_docs % spec.num_files)
                for i in range(spec.num_files)]
    chars = 0
    ks: dict[int, int] = {}
    for f, n in enumerate(per_file):
        path = src_dir / f"{f}_{spec.num_files}.jsonl"
        with open(path, "w", encoding="utf-8") as out:
            for rec in training_documents(spec.synth, f, n, seed=spec.seed, exclude=exclude):
                out.write(json.dumps(rec) + "\n")
                chars += len(rec["text"])
                ks[rec["meta"]["k"]] = ks.get(rec["meta"]["k"], 0) + 1
    with open(root / "heldout.jsonl", "w", encoding="utf-8") as out:
        for rec in heldout_records(held):
            out.write(json.dumps(rec) + "\n")
    if tokenizer:
        write_char_tokenizer(root / "tokenizer")
    info = {"source": SOURCE, "generator": GENERATOR, "synth": spec.synth.to_dict(), "num_docs": spec.num_docs,
            "num_files": spec.num_files, "seed": spec.seed, "train_chars": chars,
            "train_docs_per_k": {str(k): ks[k] for k in sorted(ks)},
            "heldout": {"file": "heldout.jsonl", "ks": list(spec.eval_ks), "per_k": spec.eval_per_k,
                        "seed": spec.eval_seed, "num": len(held)},
            "tokenizer": "tokenizer/tokenizer.json" if tokenizer else None}
    if add_sources is not None:
        info["linked_sources"] = add_sources(root)
    atomic_write_text(root / "synth.json", json.dumps(info, indent=2) + "\n")
    return info


__all__ = ["GENERATOR", "HELDOUT_KS", "HELDOUT_PER_K", "HELDOUT_SEED", "Problem", "SOURCE", "SynthConfig", "TreeSpec",
           "draw_problem", "every_update_matters", "heldout_problems", "heldout_records", "prefix_prompts",
           "run_program", "training_documents", "tree_generator", "write_char_tokenizer", "write_synth_tree"]
