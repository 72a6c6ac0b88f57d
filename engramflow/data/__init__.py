"""Offline data tools over datasets of prompts.

`datasets`  paragraphs of Python's bundled documentation as Parquet / JSONL (make-dataset).
`input`     the one reader of a job's input (a local path or a URI; Parquet or JSONL).
`rows`      the checks every prompt value goes through, and the row error kinds.
`prefill/`  prefill-job: next-token log-probabilities per prompt, replica or pipeline mode.
`access/`   access-stats: which Engram table rows a corpus touches, and how skewed that is.
"""
