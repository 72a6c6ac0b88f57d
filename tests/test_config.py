import json

import pytest

from engramflow.errors import EngramflowError
from engramflow.io import config
from engramflow.io.config import from_dict, load
from engramflow.io.presets import PRESETS, preset


def test_preset_holds_the_released_values(v41_config):
    c = v41_config
    assert c.vocab_size == 129_280 and c.dim == 5_120 and c.n_layers == 40 and c.hc_mult == 4
    assert c.engram_layer_ids == (1, 14)
    assert c.engram_num_embeddings == (384_006_168, 384_016_682)
    assert (c.engram_max_ngram_size, c.engram_n_heads, c.engram_head_dim) == (4, 8, 256)
    assert (c.engram_vocab_size, c.engram_pad_token_id, c.engram_compressed_vocab_size) == (16_000_000, 2, 99_092)
    assert c.engram_columns == 24 and c.engram_input_dim == 6_144 and c.engram_output_dim == 25_600


def _hf_style():
    flat = dict(PRESETS["deepseek-v4.1-flash"])
    flat["hidden_size"] = flat.pop("dim")
    flat["num_hidden_layers"] = flat.pop("n_layers")
    return {"architectures": ["X"], "text_config": flat}


def _official_style():
    flat = dict(PRESETS["deepseek-v4.1-flash"])
    flat["engram_pad_id"] = flat.pop("engram_pad_token_id")
    return flat


@pytest.mark.parametrize("raw", [_hf_style(), _official_style()], ids=["hf-text_config", "official-flat"])
def test_both_layouts_and_spellings_read_the_same(raw, v41_config, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load(tmp_path) == v41_config
    assert load(tmp_path / "config.json") == v41_config


def test_missing_key_is_named():
    raw = _official_style()
    del raw["engram_n_heads"]
    with pytest.raises(EngramflowError, match="engram_n_heads"):
        from_dict(raw)


def test_conflicting_spellings_are_an_error():
    raw = _official_style() | {"engram_pad_token_id": 7}
    with pytest.raises(EngramflowError, match="engram_pad_token_id.*different values"):
        from_dict(raw)


@pytest.mark.parametrize("key,value,match", [
    ("engram_num_embeddings", [5], "engram_num_embeddings.*1 entries"),
    ("engram_layer_ids", [14, 1], "strictly increasing"),
    ("engram_layer_ids", [1, 40], "n_layers=40"),
    ("engram_max_ngram_size", 1, "engram_max_ngram_size"),
    ("engram_n_heads", "8", "engram_n_heads.*'8'"),
    ("engram_n_heads", True, "engram_n_heads"),
    ("engram_compressed_vocab_size", 200_000, "exceeds vocab_size"),
    ("engram_pad_id", 129_280, "outside the vocabulary"),
])
def test_inconsistent_values_name_the_key(key, value, match):
    with pytest.raises(EngramflowError, match=match):
        from_dict(_official_style() | {key: value})


def test_unknown_preset_and_missing_or_bad_file(tmp_path):
    with pytest.raises(EngramflowError, match="unknown preset 'nope'"):
        preset("nope")
    with pytest.raises(EngramflowError, match="not found"):
        load(tmp_path / "missing.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(EngramflowError, match="not valid JSON"):
        config.load(tmp_path)
