"""Checks the command line makes before Ray starts: each is cheap, and each turns a mistake that
would otherwise surface after seconds of Ray start-up (and pages of its logs) into one line."""
from __future__ import annotations

from pathlib import Path

from engramflow.errors import EngramflowError
from engramflow.io.atomic import check_makeable


def check_output_dir(path: str | Path) -> Path:
    """An output folder: a folder already, or makeable below a writable one. Nothing is made."""
    out = Path(path).absolute()
    if out.exists() and not out.is_dir():
        raise EngramflowError(f"the output folder {out} exists and is not a folder")
    check_makeable(out, f"the output folder {out}")
    return out


def check_generation_fits(checkpoint: str | Path, prompt: str, max_new_tokens: int) -> int:
    """Tokenize `prompt` as the pipeline will and refuse prompt + `max_new_tokens` over the
    checkpoint's max_seq_len; returns the prompt's token count."""
    from engramflow.io.checkpoint import Checkpoint
    from engramflow.io.token_map import load_tokenizer

    ckpt = Checkpoint(checkpoint)  # a bad checkpoint is named here, before Ray
    try:
        limit = ckpt.config.max_seq_len
    finally:
        ckpt.close()
    n = len(load_tokenizer().encode(prompt).ids)
    if n + max_new_tokens > limit:
        raise EngramflowError(f"prompt of {n} tokens + --max-new-tokens {max_new_tokens} exceeds the checkpoint's "
                              f"max_seq_len={limit}")
    return n


def check_engine_files(ckpt) -> None:
    """Every file the engine reads besides the tensors: the token map is loaded and checked
    against the config exactly as a session history loads it."""
    from engramflow.memory.history import SessionHistory

    SessionHistory.from_checkpoint(ckpt)


def check_checkpoint_headers(checkpoint: str | Path, backbone: str | None = None) -> None:
    """What `engramflow inspect --headers-only` checks, before Ray starts (seconds, not the
    minute Ray and the actors take before a stage would name the same problem): the config,
    index and headers, the token map, the Engram wkv scales' NaN codes, and for a V4.1 backbone
    the whole name set the config implies, every tensor's shape and dtype."""
    from engramflow.io.checkpoint import Checkpoint
    from engramflow.model.backbones import check_backbone_names, default_backbone

    ckpt = Checkpoint(checkpoint)  # config, index, every header, byte ranges, wkv scales
    try:
        check_engine_files(ckpt)
        if (backbone or default_backbone(checkpoint)) == "v41":
            check_backbone_names(ckpt)
    finally:
        ckpt.close()
