"""Evaluation: ``ppl`` (half-prefill protocol, sharing penalty), ``depth_sweep`` (PPL vs depth +
plot), ``harness`` (lm-eval adapter, local tasks in ``tasks/``), ``cli`` (``megaloop eval``,
``megaloop generate``). See ``README.md`` in this folder."""
