"""Inference for looped LMs on the pure-PyTorch model (see ``engine.py`` for why not megatron).

- ``kv_cache``: terminal / per-visit KV banks — memory accounting, cache copies.
- ``engine``: ``InferenceEngine`` (prefill / decode budgets, batched generation, scoring).
- ``fixed_point``: SPEC §8 fixed-point solver; joint vs frozen-prefix iteration.
- ``adaptive``: per-token exit criteria on the engine; ``generate_cli``: ``megaloop generate``.
"""
