"""Paper reproduction suite: experiment YAMLs of arms, their runs and evaluation, and the report.

``spec`` validates experiment files (arms name the paper arms of megaloop/configs/arms.yaml),
``runs`` holds the arms' state on disk and turns an experiment into a plan of runs on
megaloop/sweep.py, ``evaluate`` runs one arm's evaluation plan, ``report`` writes results.json,
report.md and the PNGs. The command line is ``megaloop reproduce`` (``cli``).
"""
