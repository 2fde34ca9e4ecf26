"""The trusted harness that runs inside the sandbox, and the wire format of its results.

This file is executed by the sandboxed interpreter (``python -I -S -c <this source> RESULT_FD``,
standard library only, no megaloop import) and imported by the trusted parent for
:func:`decode_value`. In the sandbox it:

0. moves the result channel to fd 3 and closes every other inherited fd;
1. reads its job (JSON) from stdin — the program's source, the test calls ``[name, args, kwargs]``
   with the arguments encoded as below, the uid to drop to and the rlimits — and closes stdin;
2. drops privileges (when started as root inside the sandbox: ``setgroups([])``, ``setgid``,
   ``setuid`` to the per-run sandbox uid; this clears every capability) and sets the rlimits;
3. executes the program as module ``solution`` (top-level code of the completion runs here);
4. calls each test function with its arguments and writes one JSON line per call to RESULT_FD:
   ``{"i": k, "v": ENCODED}`` for a returned value, ``{"i": k, "exc": "TypeError"}`` for an
   exception or a value that is not plain data.

What the parent trusts, and why no authentication is needed: the completion shares this
interpreter, so it can read or replace anything here (the fd, the encoder, the harness's
memory). The parent therefore trusts the channel for one thing only: *a claim of which value the
program returned for call k*. The expected values never enter the sandbox (the parent parses
them from the test file and keeps them), the comparison happens in the parent with type-strict
equality, and a forged line can only claim a plain-data value for call k — which the function
could have returned honestly for those arguments. So forging gains nothing over answering, while
the attacks that used to pay (exit status 0, an ``assert`` that never ran, an object whose
``__eq__`` is always True) earn nothing: exit status and stdout are ignored, and only plain data
can be encoded. A second claim for the same call, a malformed line or a claim for an unknown call
makes the parent reject the whole run (reward 0).

Wire format (JSON, ``allow_nan=False``): ``None``, ``bool``, ``int`` and ``str`` as themselves;
a finite ``float`` as a JSON number with a fraction or exponent (``1.0``, never ``1``); every
other value as a one-key object: ``{"float": "nan"|"inf"|"-inf"}``, ``{"list": [...]}``,
``{"tuple": [...]}``, ``{"set": [...]}``, ``{"frozenset": [...]}``, ``{"dict": [[k, v], ...]}``,
``{"bytes": "hex"}``. Only these exact types are encoded (``type(v) is int``, so a subclass with
its own ``__eq__`` is refused). Nesting is limited to :data:`MAX_DEPTH`.

:func:`decode_value` runs in the trusted parent on bytes the program controls, so it is total and
bounded: anything that is not exactly this format (a tag with a body of the wrong type, an
unhashable set element or dict key, too deep) raises :class:`WireError` (a ``ValueError``), never
another exception; and a set, frozenset or dict whose elements (keys) share one hash value more
than :data:`MAX_SAME_HASH` times is refused, so building it costs time linear in its size (a set
of values that all hash alike, e.g. multiples of 2**61 - 1, would otherwise be quadratic).
"""

from __future__ import annotations

import json
import math
import os
import sys

MAX_DEPTH = 64
# At most this many elements of one set / frozenset (keys of one dict) may share a hash value.
# Inserting n elements that all hash alike makes CPython compare each with every earlier one
# (n**2 / 2 ``==`` calls: ~45,000 such ints fit in the 1 MiB result channel, 10-40 s of the
# trainer's CPU). With this cap the work is at most MAX_SAME_HASH compares per element, linear in
# the channel's size. Honest values essentially never have even two distinct elements with one
# hash (ints hash as ``n mod (2**61 - 1)``, strings and bytes with the parent's random key), so
# 16 refuses no realistic test value; a refused value makes the run a channel error (reward 0).
MAX_SAME_HASH = 16
_SPECIAL = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
_SEQUENCES = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


class NotPlainData(TypeError):
    """A value of a type the wire format does not carry (or nested too deeply)."""


class WireError(ValueError):
    """Data that is not the wire format (the only exception :func:`decode_value` raises)."""


def encode_value(v, depth: int = 0):
    """``v`` as wire-format JSON data (exact types only), else :class:`NotPlainData`."""
    if depth > MAX_DEPTH:
        raise NotPlainData("nested too deeply")
    t = type(v)
    if v is None or t is bool or t is int or t is str:
        return v
    if t is float:
        return v if math.isfinite(v) else {"float": repr(v)}
    if t is list or t is tuple or t is set or t is frozenset:
        items = [encode_value(x, depth + 1) for x in v]
        return {t.__name__: items}
    if t is dict:
        return {"dict": [[encode_value(k, depth + 1), encode_value(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"bytes": v.hex()}
    raise NotPlainData(f"{t.__name__} is not plain data")


def decode_value(obj, depth: int = 0):
    """Inverse of :func:`encode_value` on parsed JSON (``json.loads`` output); :class:`WireError`
    on anything malformed or oversized (see the module docstring), never another exception."""
    if depth > MAX_DEPTH:
        raise WireError("nested too deeply")
    t = type(obj)
    if obj is None or t is bool or t is int or t is str or t is float:
        return obj
    if t is not dict or len(obj) != 1:
        raise WireError(f"not a wire value: {t.__name__}")
    (tag, body), = obj.items()
    bt = type(body)
    if tag == "float" and bt is str and body in _SPECIAL:
        return _SPECIAL[body]
    if tag == "bytes" and bt is str:
        try:
            return bytes.fromhex(body)
        except ValueError:
            raise WireError("bytes: not hex") from None
    if tag in _SEQUENCES and bt is list:
        items = [decode_value(x, depth + 1) for x in body]
        if tag in ("set", "frozenset"):
            _check_hashes(items, tag)
        return _SEQUENCES[tag](items)
    if tag == "dict" and bt is list:
        pairs = []
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise WireError("dict items must be [key, value] pairs")
            pairs.append((decode_value(pair[0], depth + 1), decode_value(pair[1], depth + 1)))
        _check_hashes([k for k, _ in pairs], "dict")
        return dict(pairs)
    raise WireError(f"unknown wire tag {tag!r} or a body of type {bt.__name__}")


def _check_hashes(items: list, what: str) -> None:
    """:class:`WireError` unless every item is hashable and no hash value is shared by more than
    :data:`MAX_SAME_HASH` items (linear time: the counting dict is keyed by the hash values, ints
    that equal their own hash, so no two of its keys collide in full)."""
    counts: dict[int, int] = {}
    for x in items:
        try:
            h = hash(x)
        except TypeError:
            raise WireError(f"unhashable element in a {what}") from None
        c = counts[h] = counts.get(h, 0) + 1
        if c > MAX_SAME_HASH:
            raise WireError(f"more than {MAX_SAME_HASH} elements of a {what} share one hash value")


def _drop_and_limit(job: dict) -> None:
    import resource

    uid = job.get("uid")
    if uid is not None and os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    for name, value in job.get("rlimits", {}).items():
        lim = getattr(resource, name)
        soft, hard = (value, value + 1) if name == "RLIMIT_CPU" else (value, value)
        resource.setrlimit(lim, (soft, hard))


def main() -> None:
    out = int(sys.argv[1])
    if out != 3:  # the channel on fd 3, nothing else inherited (bwrap's info fd included)
        os.dup2(out, 3)
        os.close(out)
        out = 3
    os.closerange(4, 1 << 16)
    job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    _drop_and_limit(job)
    calls = [(name, decode_value(args), decode_value(kwargs)) for name, args, kwargs in job["calls"]]
    write = os.write
    dumps = json.dumps

    def send(rec: dict) -> None:
        data = (dumps(rec, allow_nan=False) + "\n").encode()
        while data:
            data = data[write(out, data):]

    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(job["source"], "solution.py", "exec"), namespace)
    except BaseException as err:  # SystemExit included: the module did not load
        send({"load": False, "exc": type(err).__name__})
        try:
            sys.stderr.write(f"solution.py did not load: {type(err).__name__}: {err}\n")
        except BaseException:  # noqa: BLE001
            pass
        _exit()
    send({"load": True})
    for i, (name, args, kwargs) in enumerate(calls):
        try:
            value = namespace[name](*args, **kwargs)
            rec = {"i": i, "v": encode_value(value)}
        except BaseException as err:  # noqa: BLE001 - the call failed: no value for this test
            rec = {"i": i, "exc": type(err).__name__}
        send(rec)
    _exit()


def _exit() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - the program may have replaced or closed them
            pass
    os._exit(0)


if __name__ == "__main__":
    main()
