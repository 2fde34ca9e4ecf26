"""A fix for megatron-core 0.16.1's ``fully_reshardable`` distributed-optimizer save, which wrote the
optimizer state of every parameter that follows a padded bucket end shifted.

``DistributedOptimizer.sharded_param_state_fully_reshardable`` slices the world tensors gathered by
``get_parameter_state_dp_zero`` at each parameter's ``param_index_map`` range. Those ranges count the
padding megatron puts at the end of every bucket (to a multiple of lcm(DP, 128)); the gathered world
tensors leave it out. A parameter in a later bucket is therefore saved with its first elements lost
and its tail zero-filled (megatron warns "param range exceeds unpadded buffer by N elements"). A
buffer has several buckets here only for a tied embedding at PP > 1 (``shared_embedding``: a bucket of
its own; megaloop does not overlap the grad reduce, so there are no size-based buckets): its Adam
state and FP32 master copy were saved shifted whenever the bucket before it did not end on the
padding multiple (found with tied embeddings + GQA + QK biases at PP=2: a resume lost ~1 nat).
Loading reads each parameter at its own range, so only the save needs the world tensors laid out
as the buffer is, each bucket's unpadded part at its ``offset``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


def _in_buffer_layout(state: dict | None, buffers: list) -> dict | None:
    """``get_parameter_state_dp_zero``'s result with each world tensor spread to its buffer's layout."""
    if state is None:
        return None
    for gbuf_idx, buffer in enumerate(buffers):
        for world in state[gbuf_idx].values():
            for key in STATE_KEYS:
                if key not in world:
                    continue
                flat = world[key]
                out, read = flat.new_zeros(buffer.numel), 0
                for bucket in buffer.buckets:
                    n = bucket.numel_unpadded
                    out[bucket.offset:bucket.offset + n] = flat[read:read + n]
                    read += n
                if read != flat.numel():
                    raise RuntimeError(f"optimizer state of buffer {gbuf_idx}: {flat.numel()} gathered elements, "
                                       f"the buckets hold {read} (megatron-core's layout changed?)")
                world[key] = out
    return state


@contextmanager
def buffer_layout_world_tensors(optimizer) -> Iterator[None]:
    """While the optimizer's sharded state dict is built, its gathered world tensors use the buffer's
    coordinates (see the module docstring); a no-op for an optimizer without megatron's DP buffers."""
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        gather = getattr(opt, "get_parameter_state_dp_zero", None)
        if gather is None or not hasattr(opt, "buffers"):
            continue

        def laid_out(*args, _gather=gather, _opt=opt, **kwargs):
            return _in_buffer_layout(_gather(*args, **kwargs), _opt.buffers)

        opt.get_parameter_state_dp_zero = laid_out  # an instance attribute, removed below
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt.get_parameter_state_dp_zero
