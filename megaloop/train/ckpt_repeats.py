"""Loading a sharded state dict whose rank holds the same tensor twice (interleaved pipelines).

With ``parallel.vpp`` > 1 a rank holds several model chunks, and every chunk carries its own copy
of the shared recurrent core and injection (``core.*``, ``injection.*``; their optimizer state
too) under the same sharded key and offset. Saving is fine (only the main replica is written),
but megatron-core's loader groups a rank's request by key and asserts on a key requested twice.
:func:`set_repeats_aside` leaves the first request of each tensor in place and takes the later
ones out; :func:`fill_repeats` gives them a copy of what the first one loaded.
"""

from __future__ import annotations

from typing import Any

from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject, ShardedTensor

Path_ = tuple  # keys (dict) and indices (list) from the root of a state dict


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
    mapping whose every leaf was set aside)."""
    for k in path[:-1]:
        node = node.setdefault(k, {}) if isinstance(node, dict) else node[k]
    node[path[-1]] = value


def set_repeats_aside(sd: dict) -> list[tuple[Path_, Path_]]:
    """Replace every later request of a tensor already requested in ``sd`` with None (in place);
    returns ``(repeat, first)`` paths for :func:`fill_repeats`. Empty without repeats."""
    first: dict[tuple, Path_] = {}
    repeats = []
    for path, leaf in list(_leaves(sd)):
        ident = _identity(leaf)
        if ident in first:
            repeats.append((path, first[ident]))
            _set(sd, path, None)
        else:
            first[ident] = path
    return repeats


def fill_repeats(loaded: dict, repeats: list[tuple[Path_, Path_]]) -> None:
    """Give each set-aside request a copy of what its first request loaded (in place)."""
    for path, src in repeats:
        value = _get(loaded, src)
        _set(loaded, path, value.clone() if hasattr(value, "clone") else value)
