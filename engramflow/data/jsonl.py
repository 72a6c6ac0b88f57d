"""JSONL rows parsed one line at a time, so a malformed line fails one row, not the read."""
from __future__ import annotations

import json


def is_blank(line) -> bool:
    """An empty or whitespace-only line: not a row at all (Ray's read_text drops these too, so
    a trailing newline or a blank separator line never becomes an output row)."""
    return isinstance(line, str) and not line.strip()


def json_objects(lines):
    """Yield (object, line) per non-blank line: its JSON object, or None for a line that is not
    a JSON object. Blank lines are skipped."""
    for line in lines:
        if is_blank(line):
            continue
        try:
            obj = json.loads(line)
        except (TypeError, ValueError):
            obj = None
        yield obj if isinstance(obj, dict) else None, line
