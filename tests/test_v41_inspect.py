"""`engramflow inspect` on V4.1 checkpoints: the whole released name set, headers only.

The full-size directory (~96,000 tensors, ~510 GB logical) is sparse: headers and no data.
Each corruption is made on a copy whose untouched shards are symlinks to the base shards and
only the affected shard header and the index are rewritten.
"""
import json
import time
from pathlib import Path

import pytest

from engramflow.cli.app import main
from engramflow.io.checkpoint import Checkpoint
from engramflow.model.v41.names import tensor_specs
from v41_sparse import INDEX, RELEASED_CONFIG, link_copy, shard_name, write_full_size_v41, write_index, write_shard

SMALL = Path(__file__).parent / "data" / "v41_small"


def inspect(capsys, d, *flags):
    code = main(["inspect", str(d), *flags])
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, d):
    code, out, err = inspect(capsys, d, "--headers-only")  # the name set, not the (sparse) values
    assert code == 2 and out == "", (code, out, err)
    assert err.count("\n") == 1 and err.startswith("engramflow inspect: error: ") and "Traceback" not in err
    return err.strip()


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    d = tmp_path_factory.mktemp("v41_full")
    t = time.perf_counter()
    plan = write_full_size_v41(d, RELEASED_CONFIG, shard_bytes=6 << 30)
    print(f"\nwrote {sum(map(len, plan))} tensors in {len(plan)} sparse shards in {time.perf_counter() - t:.2f} s")
    return d, plan


def edited(tmp_path, full, edit, cut_shard=None, cut=0):
    """A link copy of the full directory; edit(plan) changes a deep copy of the plan in place
    and returns the shard indices it touched; those shards and the index are rewritten."""
    base, plan = full
    plan = [list(entries) for entries in plan]
    dst = link_copy(base, tmp_path / "ckpt")
    touched = set(edit(plan))
    if cut_shard is not None:
        touched.add(cut_shard)
    weight_map, total = {}, 0
    for i, entries in enumerate(plan):
        fname = shard_name(i, len(plan))
        weight_map.update((name, fname) for name, _, _ in entries)
        if i in touched:
            total += write_shard(dst / fname, entries, cut if i == cut_shard else 0)
    write_index(dst, weight_map, total)
    return dst


def find(plan, name):
    for i, entries in enumerate(plan):
        for j, e in enumerate(entries):
            if e[0] == name:
                return i, j
    raise KeyError(name)


def test_small_checkpoint_passes(capsys):
    code, out, err = inspect(capsys, SMALL)
    doc = json.loads(out)
    assert code == 0 and err == ""
    assert doc["model"] == "deepseek-v4.1" and doc["tensors"] == 411 and doc["n_layers"] == 6
    assert doc["groups"] == {"embed": 1, "layer": 340, "engram": 8, "head": 2, "mtp": 60}
    assert doc["engram"] == Checkpoint(SMALL).summary()["engram"]
    assert "mtp.0.ffn.shared_experts.w1.weight" in tensor_specs(json.loads((SMALL / "config.json").read_text()))


def test_full_size_checkpoint_passes(capsys, full):
    d, plan = full
    t = time.perf_counter()
    code, out, err = inspect(capsys, d, "--headers-only")  # a sparse 510 GB: scanning it takes minutes
    took = time.perf_counter() - t
    with capsys.disabled():
        print(f"\ninspect of the full-size V4.1 directory ({len(plan)} shards): {took:.2f} s")
    assert code == 0, err
    doc = json.loads(out)
    specs = tensor_specs(RELEASED_CONFIG)
    assert doc["tensors"] == len(specs) == sum(map(len, plan)) > 95_000
    assert doc["n_layers"] == 40 and doc["files"] == len(plan)
    assert doc["bytes"] > 500e9
    assert doc["groups"]["layer"] > 40 * 384 * 6 and doc["groups"]["mtp"] > 3 * 128 * 6
    assert doc["groups"]["vision"] > 0 and doc["groups"]["engram"] == 8
    assert doc["engram"] == {"layer_ids": [1, 14], "rows": [384006168, 384016682], "layout_ok": True}


EXPERT = "layers.3.ffn.experts.17.w2.weight"


def test_missing_expert_tensor(capsys, tmp_path, full):
    def edit(plan):
        i, j = find(plan, EXPERT)
        del plan[i][j]
        return [i]
    err = refused(capsys, edited(tmp_path, full, edit))
    assert err.endswith(f"{EXPERT} is missing (expected I8/U8 [5120, 1152])")


@pytest.mark.parametrize("name,dtype,shape,expected", [
    (EXPERT, "BF16", (5120, 576), "I8/U8 [5120, 1152]"),  # same byte size, wrong dtype
    (EXPERT, "BF16", (5120, 1152), "I8/U8 [5120, 1152]"),
    ("layers.39.ffn.experts.383.w1.scale", "F32", (2304, 160), "F8_E8M0/U8 [2304, 160]"),
    ("mtp.2.ffn.experts.127.w3.weight", "I8", (2304, 2561), "I8/U8 [2304, 2560]"),
])
def test_wrong_dtype_or_shape(capsys, tmp_path, full, name, dtype, shape, expected):
    def edit(plan):
        i, j = find(plan, name)
        plan[i][j] = (name, dtype, shape)
        return [i]
    err = refused(capsys, edited(tmp_path, full, edit))
    assert f"{name}: expected {expected}, found {dtype} {list(shape)}" in err


def test_truncated_shard(capsys, tmp_path, full):
    _, plan = full
    i = find(plan, EXPERT)[0]
    err = refused(capsys, edited(tmp_path, full, lambda plan: [], cut_shard=i, cut=3))
    last = plan[i][-1][0]
    assert shard_name(i, len(plan)) in err and repr(last) in err and "truncated" in err


def test_left_over_tensor(capsys, tmp_path, full):
    def edit(plan):
        plan[5].append(("foo.bar", "BF16", (4,)))
        return [5]
    err = refused(capsys, edited(tmp_path, full, edit))
    assert "unexpected tensor 'foo.bar' (not implied by the config" in err


def test_index_maps_a_name_to_the_wrong_shard(capsys, tmp_path, full):
    _, plan = full
    dst = edited(tmp_path, full, lambda plan: [])
    index = json.loads((dst / INDEX).read_text())
    i = find(plan, EXPERT)[0]
    wrong = shard_name((i + 1) % len(plan), len(plan))
    index["weight_map"][EXPERT] = wrong
    (dst / INDEX).write_text(json.dumps(index))
    err = refused(capsys, dst)
    assert f"tensor {EXPERT!r} is mapped to {wrong} but that shard does not hold it" in err


def test_shard_tensor_missing_from_the_index(capsys, tmp_path, full):
    dst = edited(tmp_path, full, lambda plan: [])
    index = json.loads((dst / INDEX).read_text())
    fname = index["weight_map"].pop(EXPERT)
    (dst / INDEX).write_text(json.dumps(index))
    err = refused(capsys, dst)
    assert f"tensor {EXPERT!r} is in shard {fname} but not in the index" in err
