"""Offline data tools: a small real-text dataset and Engram access statistics.

`datasets`      paragraphs of Python's bundled documentation as Parquet / JSONL.
`access_stats`  which Engram table rows a corpus touches, and how skewed the accesses are.
"""
