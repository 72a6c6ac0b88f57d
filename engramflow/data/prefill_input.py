"""Reading prefill-job's input: a local path or any URI pyarrow understands (s3://, gs://,
file://, ...), Parquet or JSONL, a file or a directory of them.

Local paths go through access-stats' `input_format` (same messages for the same mistakes);
URIs are checked through `pyarrow.fs` so a typo fails on the driver before any actor starts.
"""
from __future__ import annotations

from pathlib import Path, PurePosixPath

import ray.data

from engramflow.data.access_stats import input_format
from engramflow.errors import EngramflowError


def is_uri(path: str) -> bool:
    return "://" in str(path)


def uri_format(uri: str) -> str:
    """parquet or jsonl for a remote file or directory, from its suffix(es)."""
    import pyarrow.fs as pafs

    try:
        fs, where = pafs.FileSystem.from_uri(uri)
        info = fs.get_file_info(where)
    except (OSError, ValueError) as e:  # unknown scheme, no credentials, bad bucket...
        raise EngramflowError(f"cannot open input {uri}: {e}") from None
    if info.type == pafs.FileType.NotFound:
        raise EngramflowError(f"input not found: {uri}")
    if info.type == pafs.FileType.Directory:
        names = [i.path for i in fs.get_file_info(pafs.FileSelector(where)) if i.type == pafs.FileType.File]
    else:
        names = [where]
    suffixes = {PurePosixPath(n).suffix.lower() for n in names}
    if ".parquet" in suffixes:
        return "parquet"
    if suffixes & {".jsonl", ".json"}:
        return "jsonl"
    raise EngramflowError(f"cannot tell the format of {uri}: expected .parquet or .jsonl files")


def resolved(path) -> str:
    """Absolute local paths: Ray workers need not share the driver's working directory."""
    return str(path) if is_uri(path) else str(Path(path).resolve())


def prompt_format(path: str) -> str:
    """parquet or jsonl; a missing input or an unknown format fails here, before Ray starts."""
    return uri_format(path) if is_uri(path) else input_format(Path(path))


def read_prompts(path: str, fmt: str, column: str, id_column: str):
    """(Ray Dataset, is_jsonl). JSONL comes as raw lines, parsed per row in the replicas so a
    malformed line fails one row; blank (empty or whitespace-only) lines are not rows and are
    dropped here, in every run alike (prefill_resume states the row rules). Parquet is narrowed
    to the two columns the job reads."""
    if fmt == "jsonl":
        return ray.data.read_text(path, drop_empty_lines=True), True
    ds = ray.data.read_parquet(path)
    names = ds.schema().names
    for name in (column, id_column):
        if name not in names:
            raise EngramflowError(f"column {name!r} is not in {path} (columns: {', '.join(names)})")
    return ds.select_columns([id_column, column]), False
