"""generate, serve and prefill-job check what `inspect --headers-only` sees before Ray starts:
a V4.1 backbone weight of the wrong shape, or an Engram wkv scale holding the E8M0 NaN code, is
one stderr line naming the tensor (exit 2, no "starting Ray" line), in seconds; each through the
real command's `main()` in process (cli_run.engramflow_here: any path to Ray fails the test)."""
import json
import os
import shutil
import struct
import time

import pytest

from cli_run import engramflow_here as engramflow, one_line_error
from engramflow.io.checkpoint import TOKEN_MAP

SHAPE_TENSOR = "layers.0.attn.wq_b.weight"
NAN_TENSOR = "layers.1.engram.wkv.scale"


def _copy_with_shard_of(src, dst, name):
    """A hard-linked copy of `src` whose shard holding `name` is a private copy; that shard's
    path, its header length and header."""
    dst.mkdir()
    for f in src.iterdir():
        (shutil.copyfile if f.name == TOKEN_MAP else os.link)(f, dst / f.name)
    shard = dst / json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"][name]
    raw = shard.read_bytes()
    shard.unlink()  # a hard link: never write through it into the shared checkpoint
    shard.write_bytes(raw)
    n = struct.unpack("<Q", raw[:8])[0]
    return shard, n, json.loads(raw[8:8 + n])


def transposed(src, dst):
    shard, n, header = _copy_with_shard_of(src, dst, SHAPE_TENSOR)
    shape = header[SHAPE_TENSOR]["shape"]
    assert shape[0] != shape[1]
    header[SHAPE_TENSOR]["shape"] = shape[::-1]  # same bytes, the wrong shape
    raw = shard.read_bytes()
    new = json.dumps(header, separators=(",", ":")).encode()
    shard.write_bytes(raw[:8] + new + b" " * (n - len(new)) + raw[8 + n:])
    return dst


def nan_scale(src, dst):
    shard, n, header = _copy_with_shard_of(src, dst, NAN_TENSOR)
    start = 8 + n + header[NAN_TENSOR]["data_offsets"][0]
    raw = bytearray(shard.read_bytes())
    raw[start] = 0xFF  # E8M0 NaN
    shard.write_bytes(bytes(raw))
    return dst


def commands(ckpt, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": 1, "text": "hello world"}\n')
    return {"generate": ["generate", "--checkpoint", ckpt, "--prompt", "hi", "--max-new-tokens", "1"],
            "serve": ["serve", "--checkpoint", ckpt, "--port", "0"],
            "prefill-job": ["prefill-job", "--checkpoint", ckpt, "--input", data, "--output", tmp_path / "o.parquet"]}


@pytest.mark.parametrize("damage, named", [(transposed, SHAPE_TENSOR), (nan_scale, NAN_TENSOR)])
def test_checked_before_ray(v41_small_preset, tmp_path, damage, named):
    ckpt = damage(v41_small_preset, tmp_path / "ckpt")
    for command, argv in commands(ckpt, tmp_path).items():
        t = time.perf_counter()
        done = engramflow(*argv)
        seconds = time.perf_counter() - t
        line = one_line_error(done)
        print(f"{command}: refused in {seconds:.1f} s: {line}")
        assert named in line and "starting" not in done.stderr.lower(), (command, line)
        assert not (tmp_path / "o.parquet").exists()


def test_inspect_names_the_same_problems(v41_small_preset, tmp_path):
    for damage, named in ((transposed, SHAPE_TENSOR), (nan_scale, NAN_TENSOR)):
        line = one_line_error(engramflow("inspect", damage(v41_small_preset, tmp_path / damage.__name__),
                                         "--headers-only"))
        assert named in line
