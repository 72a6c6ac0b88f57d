import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engramflow.errors import EngramflowError
from engramflow.io.safetensors import TensorSpec, read_header, write_file


def _library_file(path, rng):
    tensors = {
        "f32": torch.from_numpy(rng.standard_normal((3, 5)).astype(np.float32)),
        "bf16": torch.randn(4, 7).bfloat16(),
        "f16": torch.randn(2, 3, 4).half(),
        "u8": torch.from_numpy(rng.integers(0, 256, (9,), dtype=np.uint8)),
        "i64": torch.from_numpy(rng.integers(-2**40, 2**40, (6, 2))),
        "f8": torch.from_numpy(rng.integers(0, 256, (5, 8), dtype=np.uint8)).view(torch.float8_e4m3fn),
        "e8m0": torch.from_numpy(rng.integers(0, 255, (5, 1), dtype=np.uint8)).view(torch.float8_e8m0fnu),
    }
    save_file(tensors, str(path))
    return tensors


def test_header_parser_agrees_with_the_library(tmp_path, rng):
    path = tmp_path / "lib.safetensors"
    tensors = _library_file(path, rng)
    ours = read_header(path)
    raw = path.read_bytes()
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(ours)
        for name in f.keys():
            sl = f.get_slice(name)
            assert ours[name].dtype == sl.get_dtype()
            assert list(ours[name].shape) == list(sl.get_shape())
            expect = tensors[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            info = ours[name]
            assert raw[info.offset: info.offset + info.nbytes] == expect


def test_streaming_writer_is_readable_by_the_library(tmp_path, rng):
    big = rng.standard_normal((1000, 3)).astype(np.float32)
    specs = [TensorSpec("big", "F32", (1000, 3), lambda: [big[:400], big[400:]]),
             TensorSpec("codes", "F8_E4M3", (4, 4), lambda: [np.arange(16, dtype=np.uint8)])]
    path = tmp_path / "ours.safetensors"
    write_file(path, specs)
    with safe_open(str(path), framework="pt") as f:
        assert np.array_equal(f.get_tensor("big").numpy(), big)
        assert f.get_tensor("codes").view(torch.uint8).flatten().tolist() == list(range(16))
    assert not (tmp_path / "ours.safetensors.partial").exists()


def test_bad_headers_and_truncation(tmp_path, rng):
    path = tmp_path / "t.safetensors"
    _library_file(path, rng)
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    with pytest.raises(EngramflowError, match="truncated"):
        read_header(path)
    path.write_bytes(data[:20])
    with pytest.raises(EngramflowError, match="runs past"):
        read_header(path)
    path.write_bytes(struct.pack("<Q", 4) + b"{no}")
    with pytest.raises(EngramflowError, match="not valid JSON"):
        read_header(path)
    hdr = b'{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}}'
    path.write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 16)
    with pytest.raises(EngramflowError, match="needs 16 bytes but its offsets span 8"):
        read_header(path)
    hdr = b'{"x":{"dtype":"F9","shape":[4],"data_offsets":[0,4]}}'
    path.write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 16)
    with pytest.raises(EngramflowError, match="unknown dtype 'F9'"):
        read_header(path)
