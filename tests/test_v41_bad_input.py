"""Bad V4.1 configs and weights: one error naming the key or the tensor, never a torch shape error."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engramflow.errors import EngramflowError
from engramflow.model.v41.config import v41_from_dict
from engramflow.pipeline.engine import Engine
from v41_golden import V41_SMALL

CFG = json.loads((V41_SMALL / "config.json").read_text())


def edited(**changes):
    raw = dict(CFG)
    for k, v in changes.items():
        if v is None:
            raw.pop(k)
        else:
            raw[k] = v
    return raw


def test_the_small_config_parses_with_every_role():
    cfg = v41_from_dict(CFG)
    roles = cfg.roles
    assert [r.ratio for r in roles] == [0, 2, 2, 1, 1, 1]
    assert roles[1].compresses and roles[1].owns_keys and roles[2].kv_source == 1 and roles[2].index_source == 1
    assert roles[3].candidate_source and roles[3].owns_keys
    assert roles[5].indexes and not roles[5].owns_keys and roles[5].key_source == 3 and roles[5].uses_candidates
    assert roles[4].kv_source == 3 and roles[4].index_source == 3 and not roles[4].indexes


def test_the_released_schedule_roles():
    released = edited(n_layers=40, compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0], n_mtp_layers=3,
                      kv_source_layers=[2, 8, 14, 20], index_source_layers=[2, 8, 14, 20, 24, 28, 32, 36],
                      candidate_source_layer=20, engram_layer_ids=[1, 14])
    roles = v41_from_dict(released).roles
    assert [r.layer for r in roles if r.owns_keys] == [2, 8, 14, 20]
    assert roles[13].kv_source == 8 and roles[15].kv_source == 14 and roles[25].index_source == 24
    assert roles[25].kv_source == 20 and roles[24].key_source == 20 and roles[24].uses_candidates
    assert not roles[20].uses_candidates and roles[20].candidate_source


@pytest.mark.parametrize("changes,message", [
    ({"index_topk": None}, "'index_topk' is missing"),
    ({"hc_mult": "4"}, "'hc_mult' must be an integer"),
    ({"norm_eps": float("nan")}, "'norm_eps' must be a finite number"),
    ({"compress_ratios": [0, 2, 2]}, "'compress_ratios' must list"),
    ({"compress_ratios": [0, 3, 3, 1, 1, 1, 0]}, "'compress_ratios' must list a power-of-two"),
    ({"kv_source_layers": [3]}, "'kv_source_layers': layer 1 .* comes before any source"),
    ({"kv_source_layers": [0, 3]}, "'kv_source_layers' must list increasing compressed layers"),
    ({"index_source_layers": [1, 3, 5], "kv_source_layers": [1, 4]},
     "layer 3 .* but its source, layer 1, has ratio 2"),
    ({"candidate_source_layer": 4}, "'candidate_source_layer'=4 is not an index source"),
    ({"o_groups": 3}, "'o_groups': must divide n_heads"),
    ({"score_func": "relu"}, "'score_func' must be"),
])
def test_bad_configs_name_the_key(changes, message):
    with pytest.raises(EngramflowError, match=message):
        v41_from_dict(edited(**changes))


def copy_with(tmp_path, change):
    """The small checkpoint with one tensor changed (or dropped when `change` returns None)."""
    out = tmp_path / "ckpt"
    shutil.copytree(V41_SMALL, out, ignore=shutil.ignore_patterns("golden*"))
    tensors = load_file(str(out / "model.safetensors"))
    name, value = change(tensors)
    if value is None:
        del tensors[name]
    else:
        tensors[name] = value
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("change,message", [
    (lambda t: ("layers.2.attn.wq_b.weight", t["layers.2.attn.wq_b.weight"][:, :32].contiguous()),
     r"'layers.2.attn.wq_b.weight' expected F8_E4M3 \[256, 64\], found F8_E4M3 \[256, 32\]"),
    (lambda t: ("layers.4.ffn.experts.1.w2.weight", t["layers.4.ffn.experts.1.w2.weight"].view(torch.uint8).float()),
     r"'layers.4.ffn.experts.1.w2.weight' expected I8/U8 \[256, 64\], found F32"),
    (lambda t: ("layers.3.attn.indexer.wk.weight", None), r"tensor 'layers.3.attn.indexer.wk.weight' is missing"),
    (lambda t: ("layers.0.hc_ffn_scale", torch.zeros(4)), r"'layers.0.hc_ffn_scale' expected F32 \[3\]"),
    (lambda t: ("head.weight", t["head.weight"][:100].contiguous()), r"'head.weight' expected BF16/F32 \[512, 256\]"),
])
def test_bad_weights_name_the_tensor(tmp_path, change, message):
    with pytest.raises(EngramflowError, match=message):
        Engine(copy_with(tmp_path, change), backbone="v41")


def test_hf_text_config_nesting_gives_the_same_model(tmp_path):
    out = tmp_path / "hf"
    shutil.copytree(V41_SMALL, out, ignore=shutil.ignore_patterns("golden*"))
    (out / "config.json").write_text(json.dumps({"architectures": ["DeepseekV41ForCausalLM"], "text_config": CFG}))
    ids = list(range(7, 70, 3))
    flat, nested = Engine(V41_SMALL), Engine(out)
    assert nested.backbone == "v41"
    a, b = flat.open(), nested.open()
    assert torch.equal(flat.prefill(a, ids), nested.prefill(b, ids))
