"""The DSpark draft layers' settings (the `dspark_*` and `n_mtp_layers` keys of config.json).

V4.1 stores its draft layers as `mtp.0 .. mtp.{n-1}`. Each step they draft `block_size` tokens
from one forward over the block [last token, noise, noise, ...], reading the main model's
hidden states at the target layers. The draft layers' MoE may have its own expert counts
(0 = the backbone's).
"""
from __future__ import annotations

import dataclasses

from engramflow.errors import EngramflowError
from engramflow.model.v41.config import V41Config


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    n_layers: int                      # draft layers (mtp.0 ..)
    block_size: int                    # tokens drafted per forward
    noise_token_id: int                # fills the block after its first token
    target_layers: tuple[int, ...]     # backbone layers whose input h is tapped, ascending
    markov_rank: int
    moe: V41Config                     # the backbone config with the draft layers' expert counts

    def ring(self, k: int) -> str:
        """Cache buffer of draft layer k's window keys (one row per main-model position)."""
        return f"dspark_window.{k}"


def _int(raw: dict, key: str, default: int, minimum: int) -> int:
    v = raw.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise EngramflowError(f"V4.1 config key {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def dspark_config(raw: dict, cfg: V41Config) -> DSparkConfig:
    """Parse and check the draft layers' keys; errors name the key."""
    raw = {**raw, **raw["text_config"]} if isinstance(raw.get("text_config"), dict) else raw
    block = _int(raw, "dspark_block_size", 0, 0)
    n = _int(raw, "n_mtp_layers", 0, 0)
    if block == 0 or n == 0:
        raise EngramflowError("this checkpoint has no DSpark draft layers (dspark_block_size or n_mtp_layers is 0)")
    noise = _int(raw, "dspark_noise_token_id", 0, 0)
    if noise >= cfg.vocab_size:
        raise EngramflowError(f"V4.1 config key 'dspark_noise_token_id'={noise} is outside the vocabulary "
                              f"[0, {cfg.vocab_size})")
    targets = raw.get("dspark_target_layer_ids", [])
    if (not isinstance(targets, (list, tuple)) or not targets
            or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < cfg.n_layers for t in targets)
            or list(targets) != sorted(set(targets))):
        raise EngramflowError(f"V4.1 config key 'dspark_target_layer_ids' must list increasing layers "
                              f"< {cfg.n_layers}, got {targets!r}")
    experts = _int(raw, "dspark_n_routed_experts", 0, 0) or cfg.n_routed_experts
    active = _int(raw, "dspark_n_activated_experts", 0, 0) or cfg.n_activated_experts
    if active > experts:
        raise EngramflowError(f"V4.1 config key 'dspark_n_activated_experts'={active} is above the "
                              f"{experts} routed experts of the draft layers")
    return DSparkConfig(n, block, noise, tuple(targets), _int(raw, "dspark_markov_rank", 256, 1),
                        dataclasses.replace(cfg, n_routed_experts=experts, n_activated_experts=active))
