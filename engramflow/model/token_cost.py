"""What one cached token costs each stage: the bytes a session's position holds in the stage's
caches, from the config alone (the prefix cache's budget, serve's default size of it).

A position of a V4.1 stage holds, per owned layer, its window K (bf16, head_dim), and per
compressing layer 1/ratio of a compressed row (bf16) plus the compressor carry of that position
(fp32 kv and score, ratio > 1), and 1/ratio of an index-key row where the layer owns keys; a
stage after a cut also mirrors the compressed / index rows it reads from earlier stages; the
last stage of a speculative pipeline keeps one ring row (bf16, head_dim) per draft layer. The
reference backbone keeps fp32 K and V of every head; the emulated one keeps nothing.
The Engram history adds 8 bytes (one int64 compressed id) per position, and the driver's log 8
(the token id). Buffers grow by doubling, so a session may hold up to 2x this while it grows.
"""
from __future__ import annotations

HISTORY_BYTES = 8  # SessionHistory: one int64 compressed id per position
LOG_BYTES = 8  # the driver's SessionLog: one int64 token id per position


def _specs_bytes(specs: dict) -> float:
    return sum(s.width * s.dtype.itemsize / s.per for s in specs.values())


def stage_token_bytes(ckpt, kind: str | None, blocks: list[range], speculative: bool = False) -> list[int]:
    """Bytes one cached position costs on each stage (rounded up)."""
    import math

    if kind is None:
        from engramflow.model.backbones import backbone_of

        kind = backbone_of(ckpt.raw_config)
    if kind == "emulated":
        return [0 for _ in blocks]
    if kind == "reference":
        cfg = ckpt.config
        return [len(b) * 2 * cfg.n_heads * cfg.head_dim * 4 for b in blocks]
    from engramflow.model.v41.carry import mirror_specs
    from engramflow.model.v41.model import cache_specs, load_v41_config

    cfg = load_v41_config(ckpt)
    out = []
    for i, b in enumerate(blocks):
        n = _specs_bytes(cache_specs(cfg, b) | mirror_specs(cfg, b))
        if speculative and i == len(blocks) - 1:
            from engramflow.model.v41.dspark_config import dspark_config

            dcfg = dspark_config(ckpt.raw_config, cfg)
            n += dcfg.n_layers * dcfg.moe.head_dim * 2
        out.append(math.ceil(n))
    return out


def token_bytes(per_stage: list[int]) -> int:
    """All a cached position costs: every stage, the history and the log."""
    return sum(per_stage) + HISTORY_BYTES + LOG_BYTES
