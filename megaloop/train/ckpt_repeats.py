"""Loading a sharded state dict whose rank holds the same tensor twice (interleaved pipelines).

With ``parallel.vpp`` > 1 a rank holds several model chunks, and every chunk carries its own copy
of the shared recurrent core and injection (``core.*``, ``injection.*``; their optimizer state
too) under the same sharded key and offset. Saving is fine (only the main replica is written),
but megatron-core's loader groups a rank's request by key and asserts on a key requested twice.
:func:`set_repeats_aside` leaves the first request of each tensor in place and takes the later
ones out; :func:`fill_repeats` gives them a copy of what the first one loaded.

megatron-core's loader compacts lists (it keeps only their sharded items, so an item taken out
would shift the later ones: ``Float16OptimizerWithFloat16Params`` keeps its FP32 master weights
in lists of lists), so every list above a repeat is requested as a dict keyed by index and turned
back into a list of its original length after the load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject, ShardedTensor

Path_ = tuple  # keys (dict) and indices (list) from the root of a state dict


@dataclass
class Repeats:
    """What :func:`set_repeats_aside` took out: ``(repeat, first)`` leaf paths, and the lists it
    turned into dicts (path, length), outermost first."""

    pairs: list[tuple[Path_, Path_]] = field(default_factory=list)
    lists: list[tuple[Path_, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.pairs)


def _identity(leaf: ShardedBase) -> tuple:
    """What the loader reads for ``leaf``: the key and, for a tensor, its shard's offset."""
    if isinstance(leaf, ShardedObject):
        return ("object", leaf.unique_key)
    if isinstance(leaf, ShardedTensor):
        return ("tensor", leaf.key, tuple(leaf.global_offset), leaf.flattened_range)
    return (type(leaf).__name__, leaf.key)  # a factory: builds the same tensors for the same key


def _leaves(node: Any, path: Path_ = ()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, (*path, i))
    elif isinstance(node, ShardedBase):
        yield path, node


def _get(node: Any, path: Path_) -> Any:
    for k in path:
        node = node[k]
    return node


def _set(node: Any, path: Path_, value: Any) -> None:
    """Set ``path`` to ``value``, making the dicts on the way that the loader left out (it drops a
    mapping none of whose leaves it loaded)."""
    for k in path[:-1]:
        node = node.setdefault(k, {}) if isinstance(node, dict) else node[k]
    node[path[-1]] = value


def set_repeats_aside(sd: dict) -> Repeats:
    """Take every later request of a tensor already requested in ``sd`` out of it (in place; the
    lists above them become dicts keyed by index). Empty without repeats: ``sd`` is unchanged."""
    first: dict[tuple, Path_] = {}
    out = Repeats()
    for path, leaf in list(_leaves(sd)):
        ident = _identity(leaf)
        if ident in first:
            out.pairs.append((path, first[ident]))
        else:
            first[ident] = path
    lists = {}
    for path, _ in out.pairs:
        for depth in range(len(path)):
            node = _get(sd, path[:depth])
            if isinstance(node, list):
                lists[path[:depth]] = len(node)
    for lpath, n in sorted(lists.items(), key=lambda kv: len(kv[0])):  # outermost first: paths stay valid
        _get(sd, lpath[:-1])[lpath[-1]] = dict(enumerate(_get(sd, lpath)))  # the root is a dict
        out.lists.append((lpath, n))
    for path, _ in out.pairs:
        del _get(sd, path[:-1])[path[-1]]
    return out


def fill_repeats(loaded: dict, repeats: Repeats) -> None:
    """Give each request :func:`set_repeats_aside` took out a copy of what its first request loaded,
    and turn the dicts it made back into lists (in place). ValueError when a list comes back short."""
    for path, src in repeats.pairs:
        value = _get(loaded, src)
        _set(loaded, path, value.clone() if hasattr(value, "clone") else value)
    for lpath, n in reversed(repeats.lists):  # innermost first
        node = _get(loaded, lpath)
        missing = [i for i in range(n) if i not in node]
        if missing:
            raise ValueError(f"state at {'.'.join(map(str, lpath))}: items {missing} were not loaded")
        _get(loaded, lpath[:-1])[lpath[-1]] = [node[i] for i in range(n)]
