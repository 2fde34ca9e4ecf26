"""Plan a looped-LM training run before the cluster does: memory per rank, step time, pipeline
bubble and MFU of a layout, and ranked layouts for a GPU count (``megaloop plan``).

Modules: ``cluster`` (node descriptions, shipped as YAML in ``clusters/``), ``layout`` (a layout
checked with the trainer's rules; the run's depth law via its own sampler), ``stages`` (what each
virtual pipeline stage runs for a depth), ``memory`` (bytes per rank), ``pipeline_sim`` (megatron's
1F1B / interleaved schedules simulated op by op), ``cost`` (per-layer-visit compute and
communication -> step time, MFU), ``search`` (evaluate and rank layouts), ``report`` and ``cli``.
Validated against CPU runs by ``tools/plan_validation/run.py``; GPU constants are assumptions until
``tools/gpu_check.sh`` calibrates them.
"""
