"""Speculative decoding's options: `--speculative dspark[:K][:exact][:adaptive[=P]]`, checked
against the checkpoint's draft layers before anything starts. The steps themselves (draft,
verify, verdict, rollback) are the scheduler's: scheduling/speculation.py.
"""
from __future__ import annotations

from typing import NamedTuple

from engramflow.errors import EngramflowError


class SpeculativeOptions(NamedTuple):
    k: int  # drafted tokens per step; 0 = the draft block size
    exact: bool  # verified blocks run row by row (bit-equal to plain decoding on any kernels)
    threshold: float | None = None  # adaptive: draft only after a confident draft (ConfidenceGate)


SPECULATIVE_SYNTAX = "dspark[:K][:exact][:adaptive[=P]]"
DEFAULT_THRESHOLD = 0.5


def parse_speculative(spec: str | None) -> SpeculativeOptions | None:
    """'dspark[:K][:exact][:adaptive[=P]]' -> SpeculativeOptions; None/''/'off' = off. K >= 1;
    P, the adaptive gate's confidence threshold, a probability in (0, 1) (default 0.5)."""
    if spec is None or spec == "" or spec == "off":
        return None
    parts = spec.split(":") if isinstance(spec, str) else []
    if not parts or parts[0] != "dspark":
        raise EngramflowError(f"speculative must be {SPECULATIVE_SYNTAX} with K >= 1, got {spec!r}")
    k, exact, threshold = 0, False, None
    for i, part in enumerate(parts[1:]):
        if part.isdigit() and i == 0 and int(part) >= 1:
            k = int(part)
        elif part == "exact" and not exact:
            exact = True
        elif part.split("=")[0] == "adaptive" and threshold is None:
            threshold = _threshold(part, spec)
        else:
            raise EngramflowError(f"speculative must be {SPECULATIVE_SYNTAX} with K >= 1 (each part once, K "
                                  f"first), got {spec!r}: {part!r} is not understood")
    return SpeculativeOptions(k, exact, threshold)


def _threshold(part: str, spec: str) -> float:
    if part == "adaptive":
        return DEFAULT_THRESHOLD
    text = part.split("=", 1)[1]
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < 1:  # nan fails too
        raise EngramflowError(f"speculative {spec!r}: the adaptive threshold must be a probability in (0, 1), "
                              f"got {text!r}")
    return value


def check_draft_tokens(k: int, block_size: int) -> int:
    """k drafted tokens per step (0: the whole block); at most the draft layers' block size."""
    if k > block_size:
        raise EngramflowError(f"speculative dspark:{k} drafts more than the draft layers' block of {block_size}")
    return k or block_size


def draft_block_size(checkpoint) -> int:
    """The draft layers' block size from config.json (0 when the model has none)."""
    from engramflow.io.config import load_raw

    raw = load_raw(checkpoint)
    raw = {**raw, **raw["text_config"]} if isinstance(raw.get("text_config"), dict) else raw
    size = raw.get("dspark_block_size", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise EngramflowError(f"{checkpoint}: speculative decoding needs DSpark draft layers "
                              f"(config dspark_block_size is {size!r})")
    return size
