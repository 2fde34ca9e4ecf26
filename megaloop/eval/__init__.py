"""Evaluation: ``ppl`` (half-prefill protocol, sharing penalty), ``depth_sweep`` (PPL vs depth +
plot), ``states`` (depth-use diagnostics), ``synth`` (k x R answer table of the synthetic task),
``harness`` (lm-eval adapter, local tasks in ``tasks/``), ``cli`` (``megaloop eval``)."""
