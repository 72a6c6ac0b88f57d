"""Writing outputs so that a failure leaves nothing behind: a temporary name and a rename, and
the folders a run had to create, known so they can be removed again."""
from __future__ import annotations

import os
from pathlib import Path

from engramflow.errors import EngramflowError


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write via `PATH.tmp` and a rename; the temporary file never outlives a failure (and one
    left by a killed run is simply overwritten)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:  # never made, or not ours to remove (e.g. a folder of that name)
            pass
        raise


def missing_dirs(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, outermost first: what a run creates."""
    missing = []
    for d in [path, *path.parents]:
        if d.exists():
            break
        missing.append(d)
    return missing[::-1]


def remove_made_dirs(made: list[Path]) -> None:
    """Remove the folders a failed run made (from `missing_dirs`), innermost first and only
    while empty: anything someone else put there meanwhile stays, with its folders."""
    for d in sorted(made, key=lambda p: len(p.parts), reverse=True):
        try:
            d.rmdir()
        except OSError:
            break


def check_makeable(target: Path, what: str) -> None:
    """`target` can be made (nothing is made here): its nearest existing ancestor is a writable
    folder. `what` names it in the error ("the output folder /x")."""
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise EngramflowError(f"{what} cannot be made: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise EngramflowError(f"{what} cannot be written: {existing} is not writable")
