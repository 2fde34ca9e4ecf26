"""Paper reproduction suite: experiment YAMLs of arms, training/evaluation launchers and the report.

``spec`` validates experiment files, ``runner`` trains and evaluates the arms (local threads or a
slurm array), ``evaluate`` runs one arm's evaluation plan, ``report`` writes results.json,
report.md and the PNGs. The command line is tools/reproduce.py.
"""
