"""JSONL rows parsed one line at a time, so a malformed line fails one row, not the read."""
from __future__ import annotations

import json


def json_objects(lines):
    """Yield each line's JSON object, or None for a line that is not a JSON object."""
    for line in lines:
        try:
            obj = json.loads(line)
        except (TypeError, ValueError):
            obj = None
        yield obj if isinstance(obj, dict) else None, line
