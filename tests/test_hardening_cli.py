"""Hardening from a hostile review: numbers at the edges, odd text, closed pipes, bogus Ray
addresses, and leftovers of failed writes.

Every bad input: exit 2, exactly one line on stderr, no traceback, bounded time, and the file
system as it was (directory listings compared before and after). A closed stdout: status 141
(128 + SIGPIPE), nothing on stderr.
"""
import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engramflow.cli.app import EXIT_BROKEN_PIPE, main
from engramflow.errors import EngramflowError

pytestmark = pytest.mark.timeout(60)

PYTHON = sys.executable
ENV = os.environ | {"OMP_NUM_THREADS": "1"}


def listing(root: Path) -> dict[str, int]:
    """Every path under root (folders too) -> size; what 'nothing left behind' compares."""
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1) for p in sorted(root.rglob("*"))}


def run_cli(capsys, argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, match):
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err and "error:" in err, err
    assert match in err, err


def refused_port() -> int:
    """A local TCP port with nothing listening (bound and closed again)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class FakeServer:
    """A local TCP server that is not Ray: it answers `reply` (None: says nothing, b"": hangs up)
    and keeps the connection open until stopped."""

    def __init__(self, reply: bytes | None):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        self.reply, self.conns, self.stop = reply, [], threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.conns.append(conn)
            if self.reply == b"":  # hangs up at once
                conn.close()
            elif self.reply is not None:
                conn.sendall(self.reply)

    def close(self):
        self.stop.set()
        for c in self.conns:
            c.close()
        self.sock.close()


# -- class 1: numbers at the edges, odd text --------------------------------------------------

def test_sampling_api_refuses_bad_values():
    from engramflow.model.sampling import SEED_MAX, Sampling

    for t in (float("nan"), float("inf"), -float("inf"), -1, -1e-320, "0.5", True, None):
        with pytest.raises(EngramflowError, match="temperature must be >= 0 and finite"):
            Sampling(temperature=t)
    for seed in (-1, SEED_MAX + 1, 2**63, 2**64, 1.5, "7", True):
        with pytest.raises(EngramflowError, match=r"seed must be an integer in \[0, 4294967295\]"):
            Sampling(temperature=1.0, seed=seed)
    for k in (-1, 2.0, True):
        with pytest.raises(EngramflowError, match="top_k must be an integer >= 0"):
            Sampling(top_k=k)
    assert Sampling(temperature=0.5, seed=SEED_MAX).generator(2**20) is not None  # the edges work


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-300, 1e-30, 1e-8])
def test_tiny_temperatures_sample_without_overflow(temperature):
    from engramflow.model.sampling import Sampling, choose

    logits = torch.randn(129_280, generator=torch.Generator().manual_seed(3)) * 10
    logits[777] = logits.max() + 1  # a clear winner: a tiny temperature picks it every time
    for top_k in (0, 50):
        s = Sampling(temperature=temperature, top_k=top_k, seed=1)
        assert choose(logits, s, s.generator(0)) == 777


def test_huge_temperature_is_close_to_uniform():
    from engramflow.model.sampling import Sampling, choose

    s = Sampling(temperature=1e300, seed=2)
    g = s.generator(0)
    picks = {choose(torch.tensor([100.0, -100.0, 0.0, 5.0]), s, g) for _ in range(200)}
    assert picks == {0, 1, 2, 3}


def test_make_checkpoint_api_refuses_bad_seeds_before_writing(tmp_path):
    from engramflow.model.synth import make_checkpoint

    for seed in (-1, 2**32, 2**63, 2**64, 0.5, True):
        with pytest.raises(EngramflowError, match=r"seed must be an integer in \[0, 4294967295\]"):
            make_checkpoint("tiny", tmp_path / "c", seed=seed, progress=False)
    assert listing(tmp_path) == {}


SURROGATE = "caf\udce9"  # what Python makes of the argument bytes b"caf\xe9" (not UTF-8)

TEMP = "temperature must be >= 0 and finite"
NUMBER_CASES = [
    (["generate", "--checkpoint", "{ckpt}", "--prompt", "x", "--temperature", "nan"], TEMP),
    (["generate", "--checkpoint", "{ckpt}", "--prompt", "x", "--temperature", "inf"], TEMP),
    (["generate", "--checkpoint", "{ckpt}", "--prompt", "x", "--temperature", "1e400"], TEMP),
    (["generate", "--checkpoint", "{ckpt}", "--prompt", "x", "--temperature=-1e-320"], TEMP),
    (["generate", "--checkpoint", "{ckpt}", "--prompt", "x", "--temperature", "1", "--seed", "-1"],
     "seed must be an integer in [0, 4294967295], got -1"),
    (["generate", "--checkpoint", "{ckpt}", "--prompt", "x", "--seed", str(2**63)], "seed must be an integer"),
    (["generate", "--checkpoint", "{ckpt}", "--prompt", "x", "--seed", str(2**70)], "seed must be an integer"),
    (["generate", "--checkpoint", "{ckpt}", "--prompt", "x", "--block-ms", "1e9"], "argument --block-ms: must be"),
    (["generate", "--checkpoint", "{ckpt}", "--prompt", "x", "--block-ms", "inf"], "argument --block-ms: must be"),
    (["generate", "--checkpoint", "{ckpt}", "--prompt", "x", "--block-ms", "nan"], "argument --block-ms: must be"),
    (["generate", "--checkpoint", "{ckpt}", "--prompt", "x", "--block-ms", "-1"], "argument --block-ms: must be"),
    (["generate", "--checkpoint", "{ckpt}", "--prompt", "x", "--block-ms", "fast"], "is not a number"),
    (["generate", "--checkpoint", "{ckpt}", "--prompt", SURROGATE], "not valid UTF-8: lone surrogate U+DCE9"),
    (["addresses", "--text", SURROGATE], "not valid UTF-8: lone surrogate U+DCE9 at character 3"),
    (["lookup", "{ckpt}", "--layer", "1", "--text", "\ud800"], "lone surrogate U+D800"),
    (["make-checkpoint", "--preset", "tiny", "--out", "{tmp}/c", "--seed", "-1"], "seed must be an integer"),
    (["make-checkpoint", "--preset", "tiny", "--out", "{tmp}/c", "--seed", str(2**64)], "seed must be an integer"),
    (["profile", "--checkpoint", "{ckpt}", "--out", "{tmp}/p", "--duration", "inf"], "duration must be > 0"),
    (["profile", "--checkpoint", "{ckpt}", "--out", "{tmp}/p", "--duration", "nan"], "duration must be > 0"),
    (["profile", "--checkpoint", "{ckpt}", "--out", "{tmp}/p", "--duration", "1e9"], "duration must be > 0"),
    (["profile", "--checkpoint", "{ckpt}", "--out", "{tmp}/p", "--rate", "0"], "rate must be an integer in [1,"),
    (["profile", "--checkpoint", "{ckpt}", "--out", "{tmp}/p", "--block-ms", "1e9"], "argument --block-ms"),
]


@pytest.mark.timeout(60)  # the first user of tiny_ckpt also makes it; the bound is asserted inside
@pytest.mark.parametrize("argv,match", NUMBER_CASES, ids=[" ".join(c[0][:1] + c[0][-2:]) for c in NUMBER_CASES])
def test_cli_numbers_and_text_at_the_edges(tiny_ckpt, tmp_path, capsys, argv, match):
    before = listing(tmp_path)
    t = time.monotonic()
    code, out, err = run_cli(capsys, [a.replace("{ckpt}", str(tiny_ckpt)).replace("{tmp}", str(tmp_path))
                                      for a in argv])
    assert_one_line_error(code, err, match)
    assert out == "" and time.monotonic() - t < 10
    assert listing(tmp_path) == before


def test_argv_that_is_not_utf8_exits_2_in_a_real_process(tmp_path):
    r = subprocess.run([PYTHON, "-m", "engramflow.cli", "addresses", "--text", b"caf\xe9"], capture_output=True,
                       timeout=60, env=ENV, cwd=tmp_path)
    err = r.stderr.decode()
    assert r.returncode == 2 and err.count("\n") == 1 and "lone surrogate U+DCE9" in err, err
    assert listing(tmp_path) == {}


# -- Ray addresses: refused in bounded time, before anything starts -------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("address,match", [
    ("bogus", "is not auto, local or HOST:PORT"),
    ("http://10.0.0.1:6379", "is not auto, local or HOST:PORT"),
    ("127.0.0.1:99999", "is not auto, local or HOST:PORT"),
    ("127.0.0.1:0", "is not auto, local or HOST:PORT"),
    ("no-such-host.invalid:6379", "cannot reach Ray at 'no-such-host.invalid:6379'"),
    ("127.0.0.1:{refused}", "cannot reach Ray at '127.0.0.1:"),
    ("ray://127.0.0.1:{refused}", "cannot reach Ray at 'ray://127.0.0.1:"),
])
def test_cli_bogus_address_fails_fast(tiny_ckpt, tmp_path, capsys, address, match):
    address = address.replace("{refused}", str(refused_port()))
    t = time.monotonic()
    for argv in (["generate", "--checkpoint", tiny_ckpt, "--prompt", "x", "--address", address],
                 ["profile", "--checkpoint", tiny_ckpt, "--out", tmp_path / "p", "--address", address]):
        code, _, err = run_cli(capsys, argv)
        assert_one_line_error(code, err, match)
    assert time.monotonic() - t < 20
    assert listing(tmp_path) == {}


SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def headers(block: bytes) -> bytes:
    """An HTTP/2 HEADERS frame on stream 1 (END_HEADERS | END_STREAM)."""
    return len(block).to_bytes(3, "big") + b"\x01\x05\x00\x00\x00\x01" + block


# what a Ray GCS answers a GetClusterId call without a token: :status 200, grpc-status 16
GCS_REPLY = SETTINGS + headers(b"\x88\x40\x0ccontent-type\x10application/grpc"
                               b"\x00\x0bgrpc-status\x0216")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("reply,match", [
    (b"HTTP/1.1 400 Bad Request\r\n\r\n", "does not speak gRPC"),
    (b"", "closed without an answer"),
    (None, "no answer within 0.5 s"),
    (SETTINGS, "no answer within 0.5 s"),  # speaks HTTP/2 but never answers the call
    (SETTINGS + headers(b"\x8d\x76\x84"), "answered HTTP 404: not a Ray GCS"),  # a proxy in the way
    (SETTINGS + headers(b"\x88\x00\x0bgrpc-status\x0212"), "gRPC server there is not a Ray GCS"),
    (SETTINGS + len(b"x").to_bytes(3, "big") + b"\x07\x00\x00\x00\x00\x00x", "refused a Ray request"),
])
def test_address_of_something_that_is_not_ray(reply, match):
    from engramflow.cli.pipeline import check_ray_address

    server = FakeServer(reply)
    try:
        t = time.monotonic()
        with pytest.raises(EngramflowError, match=match):
            check_ray_address(f"127.0.0.1:{server.port}", timeout_s=0.5)
        assert time.monotonic() - t < 5
    finally:
        server.close()


def test_address_probe_accepts_a_ray_gcs_and_a_ray_client_server():
    """The probe's yes: a server that answers the GetClusterId call as the Ray GCS does (here:
    asking for its token) passes; at a ray:// address an HTTP/2 answer is enough."""
    from engramflow.cli.pipeline import check_ray_address

    gcs, client = FakeServer(GCS_REPLY), FakeServer(SETTINGS)
    try:
        check_ray_address(f"127.0.0.1:{gcs.port}", timeout_s=2)
        check_ray_address(f"ray://127.0.0.1:{client.port}", timeout_s=2)
        check_ray_address(None)
        check_ray_address("local")
    finally:
        gcs.close()
        client.close()


def test_ray_address_in_the_environment_is_joined_not_mixed_with_a_local_start(tiny_ckpt):
    """RAY_ADDRESS names the Ray to join when no --address is given, as ray.init reads it (the
    test suite's subprocesses join its shared instance this way): a dead one is refused in one
    line naming it, before Ray starts (not "num_cpus must not be provided" from a local start)."""
    from cli_run import engramflow, one_line_error

    port = refused_port()
    line = one_line_error(engramflow("generate", "--checkpoint", tiny_ckpt, "--prompt", "hi",
                                     env={"RAY_ADDRESS": f"127.0.0.1:{port}"}))
    assert f"cannot reach Ray at '127.0.0.1:{port}'" in line and "connection refused" in line.lower(), line


# -- closed stdout -----------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,codes", [
    (["timing-model"], {EXIT_BROKEN_PIPE}),
    (["timing-model", "--json"], {EXIT_BROKEN_PIPE}),
    # argparse itself swallows a failed write of the help text: 0 or 141, quietly either way
    (["--help"], {0, EXIT_BROKEN_PIPE}),
    (["generate", "--help"], {0, EXIT_BROKEN_PIPE}),
])
def test_closed_stdout_exits_quietly(tmp_path, argv, codes):
    p = subprocess.Popen([PYTHON, "-m", "engramflow.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=ENV, cwd=tmp_path)
    p.stdout.close()  # the reader is gone before the command writes a byte (`| head -0`)
    try:
        err = p.stderr.read().decode()
        code = p.wait(timeout=50)
    finally:
        p.kill()
    assert EXIT_BROKEN_PIPE == 141 and code in codes and err == "", (code, err)
    assert listing(tmp_path) == {}


def test_reader_that_stops_after_one_line(tmp_path):
    """`engramflow timing-model | head -1`: the first line arrives, then a quiet 141 or 0 (when
    everything fitted in the pipe before the reader left)."""
    p = subprocess.Popen([PYTHON, "-m", "engramflow.cli", "timing-model"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=ENV, cwd=tmp_path)
    first = p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode()
    assert b"path" in first and p.wait(timeout=50) in (0, 141) and err == "", err


def test_a_broken_pipe_that_is_not_stdout_is_an_ordinary_error(capsys, monkeypatch):
    from engramflow.cli import timing

    def boom(args):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(timing, "cmd_timing_model", boom)
    code, _, err = run_cli(capsys, ["timing-model"])  # stdout is captured, not a closed pipe
    assert_one_line_error(code, err, "Broken pipe")


# -- class 2: leftovers of failed writes ---------------------------------------------------------

def test_token_map_onto_a_folder_leaves_nothing(tmp_path, capsys):
    (tmp_path / "map.bin").mkdir()
    before = listing(tmp_path)
    t = time.monotonic()
    code, _, err = run_cli(capsys, ["token-map", "export", "--out", tmp_path / "map.bin"])
    assert_one_line_error(code, err, "it is a folder")
    assert time.monotonic() - t < 5  # refused before the slow build
    code, _, err = run_cli(capsys, ["token-map", "export", "--out", tmp_path / "missing" / "map.bin"])
    assert_one_line_error(code, err, "does not exist")
    assert listing(tmp_path) == before


def test_token_map_save_cleans_and_reuses_its_temporary(tmp_path, monkeypatch):
    from engramflow.io import token_map
    from engramflow.io.token_map import TokenMap

    tm = TokenMap(np.arange(10, dtype=np.uint32))
    (tmp_path / "d").mkdir()
    with pytest.raises(EngramflowError, match="it is a folder"):
        tm.save(tmp_path / "d")
    (tmp_path / "m.bin.tmp").write_bytes(b"left by a killed run")
    tm.save(tmp_path / "m.bin")  # reused
    assert listing(tmp_path) == {"d": -1, "m.bin": 40}

    def fail(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link", str(dst))

    monkeypatch.setattr(token_map.os, "replace", fail)
    with pytest.raises(OSError):
        tm.save(tmp_path / "n.bin")
    assert listing(tmp_path) == {"d": -1, "m.bin": 40}


def test_safetensors_writer_removes_its_partial_file(tmp_path):
    from engramflow.io.safetensors import TensorSpec, read_header, write_file

    def chunks():
        yield np.zeros(8, np.uint8)
        raise OSError(errno.ENOSPC, "No space left on device")

    spec = TensorSpec("t", "U8", (16,), chunks)
    with pytest.raises(OSError, match="No space"):
        write_file(tmp_path / "a.safetensors", [spec])
    (tmp_path / "b.safetensors").mkdir()
    with pytest.raises(EngramflowError, match="it is a folder"):
        write_file(tmp_path / "b.safetensors", [TensorSpec("t", "U8", (8,), lambda: [np.zeros(8, np.uint8)])])
    assert listing(tmp_path) == {"b.safetensors": -1}
    (tmp_path / "c.safetensors.partial").write_bytes(b"left by a killed run")
    write_file(tmp_path / "c.safetensors", [TensorSpec("t", "U8", (8,), lambda: [np.ones(8, np.uint8)])])
    assert set(listing(tmp_path)) == {"b.safetensors", "c.safetensors"}
    assert read_header(tmp_path / "c.safetensors")["t"].nbytes == 8


def _shard_names(ckpt: Path) -> list[str]:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))


@pytest.mark.timeout(120)
def test_make_checkpoint_with_a_blocked_shard_path(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "c"
    (out / _shard_names(tiny_ckpt)[1]).mkdir(parents=True)  # the second shard's name is a folder
    (out / "notes.txt").write_text("mine")
    before = listing(tmp_path)
    code, _, err = run_cli(capsys, ["make-checkpoint", "--preset", "tiny", "--out", out, "--quiet"])
    assert_one_line_error(code, err, "is a folder")
    assert listing(tmp_path) == before


@pytest.mark.timeout(180)
@pytest.mark.parametrize("existing", [False, True])
def test_make_checkpoint_failing_midway_removes_what_it_wrote(tiny_ckpt, tmp_path, capsys, monkeypatch, existing):
    from engramflow.model import synth

    real, calls = synth.write_file, []

    def second_shard_fails(path, specs, **kw):
        calls.append(path)
        if len(calls) == 2:  # the disk fills up in the middle of the second shard
            first = specs[0]
            orig = first.chunks

            def chunks():
                yield next(iter(orig()))
                raise OSError(errno.ENOSPC, "No space left on device")

            specs = [synth.TensorSpec(first.name, first.dtype, first.shape, chunks), *specs[1:]]
        return real(path, specs, **kw)

    monkeypatch.setattr(synth, "write_file", second_shard_fails)
    out = tmp_path / "new" / "c"
    if existing:  # a user's folder with a file of theirs and an older config: both stay as they were
        out.mkdir(parents=True)
        (out / "notes.txt").write_text("mine")
        (out / "config.json").write_text("{}")
    before = listing(tmp_path)
    code, _, err = run_cli(capsys, ["make-checkpoint", "--preset", "tiny", "--out", out, "--quiet"])
    assert_one_line_error(code, err, "No space left on device")
    assert len(calls) == 2
    assert listing(tmp_path) == before
    if existing:
        assert (out / "notes.txt").read_text() == "mine" and (out / "config.json").read_text() == "{}"


@pytest.mark.timeout(60)
def test_profile_that_fails_leaves_no_folder(tiny_ckpt, tmp_path, capsys):
    code, _, err = run_cli(capsys, ["profile", "--checkpoint", tiny_ckpt, "--out", tmp_path / "a" / "p",
                                    "--stages", "0"])
    assert_one_line_error(code, err, "stages")
    assert listing(tmp_path) == {}
    # a folder that was there stays as it was; a staging folder left by a killed run is cleared
    out = tmp_path / "p"
    (out / ".profile.partial" / "flamegraphs").mkdir(parents=True)
    (out / "summary.json").write_text("{}")
    # (more stages than blocks: a check that needs the checkpoint, made after the staging folder is cleared)
    code, _, err = run_cli(capsys, ["profile", "--checkpoint", tiny_ckpt, "--out", out, "--stages", "999"])
    assert_one_line_error(code, err, "stages")
    assert listing(tmp_path) == {"p": -1, "p/summary.json": 2}
    # an output file in the way is named before anything runs
    (out / "trace.json").mkdir()
    code, _, err = run_cli(capsys, ["profile", "--checkpoint", tiny_ckpt, "--out", out])
    assert_one_line_error(code, err, "trace.json: it is a folder")
