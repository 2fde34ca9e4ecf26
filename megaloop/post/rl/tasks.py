"""Verifiable reward tasks for RL and the small text interface they share with the trainer.

* :class:`Example` — a prompt and what the reward function needs to check a completion.
* :class:`RewardFn` — ``reward(example, completion_text) -> float``; exact, deterministic checks.
* :class:`Task` — ``sample(n, rng) -> list[Example]`` plus a ``reward``; tasks plug into
  :func:`megaloop.post.rl.grpo.train` unchanged.

Built in: :class:`ArithmeticTask` (``"3+4="`` → ``"7"``, checked exactly), :class:`JsonlTask`
(prompt/answer records, e.g. GSM8K exported to JSONL, with :class:`FinalNumberReward` or
:class:`ExactMatchReward`), and :class:`ByteTokenizer` (bytes + EOS) for byte-level toy models.
The MBPP+-style code task (:class:`megaloop.post.rl.sandbox.CodeTask`, ``mbpp:PATH.jsonl`` or
``mbpp:tiny``) runs each completion in a bubblewrap sandbox and judges the values its function
returns in the trusted parent (type-strict, see :mod:`megaloop.post.rl.verdict`).
"""

from __future__ import annotations

import decimal
import hashlib
import json
import math
import random
import re
import sys
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from megaloop.post.rl.examples import Example, read_jsonl


@runtime_checkable
class RewardFn(Protocol):
    def __call__(self, example: Example, completion: str) -> float: ...


@runtime_checkable
class Task(Protocol):
    name: str

    def sample(self, n: int, rng: random.Random) -> list[Example]: ...

    def reward(self, example: Example, completion: str) -> float: ...


@runtime_checkable
class TextTokenizer(Protocol):
    """What RL/distillation need from a tokenizer (``megaloop.data.tokenizer.Tokenizer`` fits)."""

    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


# ----------------------------------------------------------------------------- rewards
_INT = re.compile(r"-?\d+")
_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def leading_integer(text: str) -> str | None:
    """The integer the completion starts with (after spaces), or None: ``" 17\\n..." → "17"``."""
    m = _INT.match(text.lstrip(" "))
    return m.group(0) if m else None


class ExactAnswerReward:
    """1.0 when the completion starts with exactly the answer, followed by a non-digit or the end
    (``"7"``, ``"7\\n"``, ``"7 is"`` for answer 7; not ``"72"``, ``"07"``); else 0.0."""

    def __call__(self, example: Example, completion: str) -> float:
        return 1.0 if leading_integer(completion) == example.answer.strip() else 0.0


def _norm_number(s: str) -> str:
    """The number's exact canonical text (``"1,000.50"`` → ``"1000.5"``, ``"-0"`` → ``"0"``); the text
    itself when it is no finite number. Decimal, not float: floats made integers past 2^53 equal
    and a 309-digit number infinite (``int(inf)`` raised mid-run)."""
    s = s.replace(",", "").strip()
    try:
        v = decimal.Decimal(s)
    except decimal.InvalidOperation:
        return s
    if not v.is_finite():
        return s
    if v.is_zero():
        return "0"
    return format(decimal.Context(prec=max(28, len(s))).normalize(v), "f")


class FinalNumberReward:
    """GSM8K-style: the number after ``####`` if the completion has one, else its last number,
    compared numerically (commas ignored) with ``example.answer``."""

    def __call__(self, example: Example, completion: str) -> float:
        tail = completion.split("####")[-1] if "####" in completion else completion
        nums = _NUM.findall(tail)
        if not nums:
            return 0.0
        pick = nums[0] if "####" in completion else nums[-1]
        return 1.0 if _norm_number(pick) == _norm_number(example.answer) else 0.0


class ExactMatchReward:
    """1.0 when the stripped completion (cut at the first newline) equals the stripped answer."""

    def __call__(self, example: Example, completion: str) -> float:
        return 1.0 if completion.split("\n")[0].strip() == example.answer.strip() else 0.0


# ----------------------------------------------------------------------------- tasks
class ArithmeticTask:
    """Single-digit arithmetic: prompts ``"a+b="`` (and ``"a-b="`` with a ≥ b, ``ops="+-"``),
    answer the exact result; reward :class:`ExactAnswerReward`."""

    name = "arithmetic"

    def __init__(self, ops: str = "+", lo: int = 0, hi: int = 9, prefix: str = ""):
        if not ops or set(ops) - set("+-*"):
            raise ValueError(f"ops must use '+', '-', '*', got {ops!r}")
        self.ops, self.lo, self.hi, self.prefix = ops, lo, hi, prefix
        self._reward = ExactAnswerReward()

    def make(self, a: int, op: str, b: int) -> Example:
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Example(prompt=f"{self.prefix}{a}{op}{b}=", answer=str(value), meta={"a": a, "b": b, "op": op})

    def sample(self, n: int, rng: random.Random) -> list[Example]:
        out = []
        for _ in range(n):
            op = rng.choice(self.ops)
            a, b = rng.randint(self.lo, self.hi), rng.randint(self.lo, self.hi)
            if op == "-" and a < b:
                a, b = b, a
            out.append(self.make(a, op, b))
        return out

    def reward(self, example: Example, completion: str) -> float:
        return self._reward(example, completion)


class JsonlTask:
    """Prompt/answer records from a JSONL file (``{"prompt": ..., "answer": ...}``; other keys
    kept in ``meta``), e.g. GSM8K with ``answer`` the final number. ``template`` formats the
    prompt (``"Question: {prompt}\\nAnswer:"``); ``prompt_key`` may list alternatives (the first
    present is used), ``answer_fn`` maps the stored answer to the reference string and
    ``answer_check`` (optional) says what is wrong with one (``ValueError`` naming ``file:line``)."""

    def __init__(self, path: str | Path, reward: RewardFn | None = None, template: str = "{prompt}",
                 prompt_key: str | Sequence[str] = "prompt", answer_key: str = "answer", name: str | None = None,
                 answer_fn: Callable[[str], str] = str, prompt_key_note: str = "",
                 answer_check: Callable[[str], str | None] | None = None):
        self.path = Path(path)
        self.name = name or self.path.stem
        keys = (prompt_key,) if isinstance(prompt_key, str) else tuple(prompt_key)
        self.examples = []
        for lineno, rec in read_jsonl(self.path, required=(answer_key,)):
            key = next((k for k in keys if k in rec), None)
            if key is None:
                raise ValueError(f"{self.path}:{lineno}: missing key {keys[0]!r}{prompt_key_note}")
            prompt, raw = rec[key], rec[answer_key]
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"{self.path}:{lineno}: {key!r} must be a non-empty string, got {_shown(prompt)}")
            if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):  # numbers: "answer": 7
                raise ValueError(f"{self.path}:{lineno}: {answer_key!r} must be a string or a number, got "
                                 f"{_shown(raw)}")
            meta = {k: v for k, v in rec.items() if k not in (key, answer_key)}
            if isinstance(raw, float) and not math.isfinite(raw):
                raise ValueError(f"{self.path}:{lineno}: {answer_key!r} is {raw}: give a finite number")
            # "answer": 7.0 is 7 (str gave "7.0", which a completion "7" never matched under exact:)
            answer = answer_fn(str(int(raw)) if isinstance(raw, float) and raw.is_integer() else str(raw))
            problem = answer_check(answer) if answer_check else None
            if problem:
                raise ValueError(f"{self.path}:{lineno}: {problem}")
            self.examples.append(Example(template.format(prompt=prompt), answer, meta))
        if not self.examples:
            raise ValueError(f"{self.path}: no records")
        self._reward = reward or FinalNumberReward()

    def sample(self, n: int, rng: random.Random) -> list[Example]:
        return [rng.choice(self.examples) for _ in range(n)]

    def reward(self, example: Example, completion: str) -> float:
        return self._reward(example, completion)


def _shown(value: Any) -> str:
    """A record's value as JSON, cut short (``null``, ``""``, ``["a"]``) for a message."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def gsm8k_answer(answer: str) -> str:
    """GSM8K's published answer is a worked solution ending ``#### 72``: the number after the last
    ``####``; an answer without one is taken as it is."""
    return answer.rsplit("####", 1)[1].strip() if "####" in answer else answer


def gsm8k_answer_problem(answer: str) -> str | None:
    """Why a GSM8K reference answer can never earn reward 1 (None when it can): the reward compares
    the completion's final number with it, so it must be one number (``72``, ``-3``, ``1,000``, ``2.5``)."""
    if _NUM.fullmatch(answer.strip()):
        return None
    return (f"answer {answer[:60]!r} is not a number (the reward compares the completion's final number with "
            "it, so it could never be 1): give the final number, or GSM8K's solution ending '#### 72'")


def exact_answer_problem(answer: str) -> str | None:
    """Why an ``exact:`` answer can never earn reward 1 (None when it can): the reward compares the
    completion's first line, stripped, with the stripped answer."""
    if "\n" in answer.strip():
        return (f"answer {answer[:60]!r} spans several lines (the reward compares the completion's first line "
                "with it, so it could never be 1): give a one-line answer")
    return None


class Gsm8kTask(JsonlTask):
    """GSM8K records as megaloop writes them (``prompt``, ``answer`` = the final number) or as the
    dataset is published (``question``, ``answer`` = the worked solution ending ``#### 72``). A record
    whose answer is not one number is refused naming ``file:line``."""

    def __init__(self, path: str | Path, template: str = "Question: {prompt}\nAnswer:"):
        super().__init__(path, FinalNumberReward(), template, prompt_key=("prompt", "question"), name="gsm8k",
                         answer_fn=gsm8k_answer, prompt_key_note=" (or GSM8K's 'question')",
                         answer_check=gsm8k_answer_problem)


class CallableRewardTask:
    """Wraps another task with a different :class:`RewardFn` (shaped rewards, tests)."""

    def __init__(self, task: Task, reward: RewardFn, name: str | None = None):
        self.task, self._reward = task, reward
        self.name = name or f"{task.name}+reward"

    def sample(self, n: int, rng: random.Random) -> list[Example]:
        return self.task.sample(n, rng)

    def reward(self, example: Example, completion: str) -> float:
        return self._reward(example, completion)


TASKS = {"arithmetic": lambda: ArithmeticTask("+"), "arithmetic-pm": lambda: ArithmeticTask("+-")}


def make_task(spec: str, *, reward_workers: int = 1, unsafe_code_exec: bool = False,
              reward_mode: str = "all") -> Task:
    """``arithmetic`` | ``arithmetic-pm`` | ``gsm8k:PATH.jsonl`` | ``exact:PATH.jsonl`` |
    ``mbpp:PATH.jsonl`` (``mbpp:tiny``: the shipped sample). The keyword options configure the
    code-execution reward of ``mbpp:`` (:class:`megaloop.post.rl.sandbox.CodeTaskConfig`); building it
    raises :class:`~megaloop.post.rl.sandbox.SandboxUnavailable` (a ``ValueError``) when no sandbox
    works and ``unsafe_code_exec`` is False."""
    if spec in TASKS:
        return TASKS[spec]()
    kind, _, path = spec.partition(":")
    if kind == "mbpp" and path:
        from megaloop.post.rl.sandbox import CodeTask, CodeTaskConfig

        return CodeTask(path, config=CodeTaskConfig(reward_mode=reward_mode, workers=reward_workers,
                                                    unsafe_code_exec=unsafe_code_exec))
    if kind == "gsm8k" and path:
        return Gsm8kTask(path)
    if kind == "exact" and path:
        task = JsonlTask(path, ExactMatchReward(), answer_check=exact_answer_problem)
        if empty := sum(not e.answer.strip() for e in task.examples):  # rewarded silently: said once
            print(f"warning: {path}: {empty} of {len(task.examples)} answers are empty: the reward is 1 for a "
                  "completion that ends at once (or starts with a newline), which RL then trains the model to do",
                  file=sys.stderr, flush=True)
        return task
    raise ValueError(f"unknown task {spec!r}; one of {sorted(TASKS)}, gsm8k:PATH.jsonl, exact:PATH.jsonl, "
                     "mbpp:PATH.jsonl")


FILE_TASKS = ("gsm8k", "exact", "mbpp")


def task_file(spec: str) -> Path | None:
    """The file a ``KIND:PATH`` task reads (``mbpp:tiny``: the shipped sample), else None."""
    kind, _, path = spec.partition(":")
    if kind not in FILE_TASKS or not path:
        return None
    if kind == "mbpp" and path == "tiny":
        from megaloop.post.rl.sandbox import DATA_DIR

        return DATA_DIR / "mbpp_tiny.jsonl"
    return Path(path)


def task_spec(spec: str) -> str:
    """``spec`` with its file made absolute (``exact:data.jsonl`` → ``exact:/work/data.jsonl``), so the
    same file named from another folder or by another path reads the same; other specs unchanged."""
    kind, _, path = spec.partition(":")
    if task_file(spec) is None or (kind == "mbpp" and path == "tiny"):
        return spec
    return f"{kind}:{Path(path).resolve()}"


def task_identity(spec: str) -> dict:
    """What a run records of its ``--task`` (compared on ``--resume``): ``task`` (:func:`task_spec`) and
    ``task_sha256``, the SHA-256 of the task's file (None for a built-in task)."""
    f = task_file(spec)
    return {"task": task_spec(spec), "task_sha256": None if f is None else hashlib.sha256(f.read_bytes()).hexdigest()}


# ----------------------------------------------------------------------------- tokenizers
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, EOS = 256 (``vocab_size`` 257)."""

    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def describe(self) -> dict[str, Any]:
        return {"kind": "bytes", "vocab_size": self.vocab_size, "eos_id": self.eos_id}
