"""access-stats: how often each Engram row is read over a dataset (stats.py), with its report
and hit-rate curves."""
