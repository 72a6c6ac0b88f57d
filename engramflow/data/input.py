"""The one reader of a job's input: a local path or any URI pyarrow understands (s3://, gs://,
file://, ...), Parquet or JSONL, a file or a directory of them.

`input_format` tells the format from the suffixes, and fails on a missing input or an unknown
format on the driver, before Ray starts (a URI is checked through `pyarrow.fs`). `read_input`
gives a Ray Dataset of the named columns; `local_batches` reads a local input in file order,
in this process (for statistics that depend on the order of tokens).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pyarrow as pa

from engramflow.errors import EngramflowError


def is_uri(path) -> bool:
    return "://" in str(path)


def resolved(path) -> str:
    """Absolute local paths: Ray workers need not share the driver's working directory."""
    return str(path) if is_uri(path) else str(Path(path).resolve())


def _names(path: str) -> list[str]:
    """The file names the input consists of (a directory's files), checked to exist."""
    if not is_uri(path):
        p = Path(path)
        if not p.exists():
            raise EngramflowError(f"input not found: {path}")
        return [q.name for q in p.iterdir()] if p.is_dir() else [p.name]
    import pyarrow.fs as pafs

    try:
        fs, where = pafs.FileSystem.from_uri(path)
        info = fs.get_file_info(where)
    except (OSError, ValueError) as e:  # unknown scheme, no credentials, bad bucket...
        raise EngramflowError(f"cannot open input {path}: {e}") from None
    if info.type == pafs.FileType.NotFound:
        raise EngramflowError(f"input not found: {path}")
    if info.type == pafs.FileType.Directory:
        return [i.path for i in fs.get_file_info(pafs.FileSelector(where)) if i.type == pafs.FileType.File]
    return [where]


def input_format(path) -> str:
    """parquet or jsonl, from the file suffix (or the suffixes of the files in a directory)."""
    suffixes = {PurePosixPath(n).suffix.lower() for n in _names(str(path))}
    if ".parquet" in suffixes:
        return "parquet"
    if suffixes & {".jsonl", ".json"}:
        return "jsonl"
    raise EngramflowError(f"cannot tell the format of {path}: expected .parquet or .jsonl files")


def read_input(path, columns: list[str]):
    """(Ray Dataset, is_jsonl). JSONL comes as raw lines, parsed per row by the workers so a
    malformed line fails one row, not the read; blank lines are not rows and are dropped here,
    in every run alike. Parquet is narrowed to `columns`, which must all be there."""
    import ray.data

    path = str(path)
    if input_format(path) == "jsonl":
        return ray.data.read_text(path, drop_empty_lines=True), True
    ds = ray.data.read_parquet(path)
    names = ds.schema().names
    for name in columns:
        if name not in names:
            raise EngramflowError(f"column {name!r} is not in {path} (columns: {', '.join(names)})")
    return ds.select_columns(list(columns)), False


def local_batches(path: Path, column: str, batch_rows: int = 256) -> Iterator[pa.Table]:
    """A local input's rows in file order (files sorted by name), in tables of `batch_rows`:
    JSONL as raw lines in a "text" column (blank lines dropped), Parquet as `column`."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    if input_format(path) == "jsonl":
        lines: list[str] = []
        for f in (f for f in files if f.suffix.lower() in (".jsonl", ".json")):
            with open(f, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if line.strip():
                        lines.append(line)
                    if len(lines) >= batch_rows:
                        yield pa.table({"text": lines})
                        lines = []
        if lines:
            yield pa.table({"text": lines})
        return
    import pyarrow.parquet as pq

    for f in (f for f in files if f.suffix.lower() == ".parquet"):
        for b in pq.ParquetFile(f).iter_batches(batch_size=batch_rows, columns=[column]):
            yield pa.Table.from_batches([b])
