import hashlib
import json
import shutil

import numpy as np
import pytest

from ckpt_builders import engram_arrays, write_single
from engramflow.errors import EngramflowError
from engramflow.io.checkpoint import INDEX, Checkpoint, engram_names
from engramflow.model.synth import make_checkpoint, synth_config


def test_tiny_checkpoint_opens_with_official_names_and_dtypes(tiny_ckpt):
    ckpt = Checkpoint(tiny_ckpt)
    cfg = ckpt.config
    assert cfg.vocab_size == 129_280 and cfg.engram_layer_ids == (1, 14)
    s = ckpt.summary()
    assert s["engram"]["layout_ok"] and s["engram"]["rows"] == list(cfg.engram_num_embeddings)
    for layer in cfg.engram_layer_ids:
        n = engram_names(layer)
        assert s["tensors"][n["embed.weight"]]["dtype"] == "F8_E4M3"
        assert s["tensors"][n["embed.scale"]]["dtype"] == "F8_E8M0"
        assert s["tensors"][n["wkv.weight"]]["dtype"] == "F8_E4M3"
        assert s["tensors"][n["q_weight"]]["dtype"] == "BF16"
    assert len({t["file"] for t in s["tensors"].values()}) > 1  # really sharded
    index = json.loads((tiny_ckpt / INDEX).read_text())
    assert set(index["weight_map"]) == set(s["tensors"])


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_truncated_shard_fails_at_load_naming_file_and_tensor(tiny_ckpt, tmp_path):
    root = _copy(tiny_ckpt, tmp_path / "t")
    info = Checkpoint(root).info(engram_names(14)["embed.weight"])
    with open(info.file, "r+b") as f:
        f.truncate(info.offset + info.nbytes - 1)
    with pytest.raises(EngramflowError, match=rf"{info.file.name}: tensor 'layers.14.engram.embed.weight'.*truncated"):
        Checkpoint(root)


def test_missing_shard_and_bad_index_entries(tiny_ckpt, tmp_path):
    root = _copy(tiny_ckpt, tmp_path / "m")
    index = json.loads((root / INDEX).read_text())
    name = engram_names(1)["wkv.weight"]
    real = index["weight_map"][name]
    other = next(f for f in set(index["weight_map"].values()) if f != real)
    index["weight_map"][name] = other
    (root / INDEX).write_text(json.dumps(index))
    with pytest.raises(EngramflowError, match=rf"'{name}' is mapped to {other} but that shard does not hold it"):
        Checkpoint(root)
    index["weight_map"][name] = real
    (root / INDEX).write_text(json.dumps(index))
    (root / real).unlink()
    with pytest.raises(EngramflowError, match=f"shard {real} is listed but missing"):
        Checkpoint(root)


@pytest.fixture(scope="module")
def small_cfg():
    return synth_config("tiny")


def _cfg_dict(cfg):
    return cfg.to_dict()


def test_wrong_dtype_shape_and_too_few_rows(small_cfg, tmp_path):
    arrays = engram_arrays(small_cfg)
    name = engram_names(14)["embed.weight"]
    ok = write_single(tmp_path / "ok", _cfg_dict(small_cfg), arrays)
    Checkpoint(ok)

    bad = dict(arrays) | {name: ("BF16", arrays[name][1].view(np.uint16)[:, :16])}
    with pytest.raises(EngramflowError, match=rf"tensor '{name}' has dtype BF16, expected F8_E4M3"):
        Checkpoint(write_single(tmp_path / "dtype", _cfg_dict(small_cfg), bad))

    scale = engram_names(1)["embed.scale"]
    rows = small_cfg.engram_num_embeddings[0]
    bad = dict(arrays) | {scale: ("F8_E8M0", arrays[scale][1][:-1])}
    with pytest.raises(EngramflowError, match=rf"tensor '{scale}' has shape \[{rows - 1}, 1\], expected \[{rows}, 1\]"):
        Checkpoint(write_single(tmp_path / "shape", _cfg_dict(small_cfg), bad))

    rows = [r - 1 for r in small_cfg.engram_num_embeddings]
    short_cfg = _cfg_dict(small_cfg) | {"engram_num_embeddings": rows}
    with pytest.raises(EngramflowError, match=rf"layer 1 table has {rows[0]} rows, fewer than the layout's prime sum {rows[0] + 1}"):
        Checkpoint(write_single(tmp_path / "rows", short_cfg, engram_arrays(small_cfg, rows)))

    missing = {k: v for k, v in arrays.items() if k != engram_names(1)["wkv.scale"]}
    with pytest.raises(EngramflowError, match="'layers.1.engram.wkv.scale' is missing"):
        Checkpoint(write_single(tmp_path / "missing", _cfg_dict(small_cfg), missing))


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(EngramflowError, match="directory not found"):
        Checkpoint(tmp_path / "none")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(EngramflowError, match="config key 'vocab_size' is missing"):
        Checkpoint(tmp_path)


def _digest(root):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def test_make_checkpoint_is_deterministic(tiny_ckpt, tmp_path):
    again = make_checkpoint("tiny", tmp_path / "again", seed=0, progress=False)
    assert _digest(again) == _digest(tiny_ckpt)
    other = make_checkpoint("tiny", tmp_path / "other", seed=1, progress=False)
    a, b = _digest(other), _digest(tiny_ckpt)
    assert a.keys() == b.keys() and any(a[k] != b[k] for k in a if k.endswith(".safetensors"))
