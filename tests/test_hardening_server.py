"""Hostile review of `engramflow serve-table`: secret files, numeric options, unauthenticated
floods, and table files truncated or rewritten under a mapping (an error, never SIGBUS).

Everything listens and connects on 127.0.0.1 only; loops and waits are bounded.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from engramflow.cli.app import main
from engramflow.errors import EngramflowError
from engramflow.io.checkpoint import engram_names
from engramflow.memory.safe_mmap import MappedFileChanged, read_array
from engramflow.memory.tables import EngramTable
from engramflow.tiers import RemoteRamSource, TableServer, TierError
from engramflow.tiers import protocol as P
from test_tiers_fixtures import SECRET, small_checkpoint

LAYER = 1
HOST = "127.0.0.1"


def _secret(tmp_path, mode=0o600, data=SECRET + b"\n", name="secret"):
    path = tmp_path / name
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def _serve_args(ckpt_root, secret, *extra):
    return ["serve-table", "--checkpoint", str(ckpt_root), "--layer", str(LAYER), "--host", HOST, "--port", "0",
            "--secret-file", str(secret), *extra]


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# -- secret files -----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o606, 0o666, 0o700 | 0o010, 0o602])
def test_secret_file_open_to_others_refused(tmp_path, mode):
    path = _secret(tmp_path, mode)
    with pytest.raises(EngramflowError, match=f"has mode {mode:04o}, accessible by group or others.*chmod 600"):
        P.read_secret_file(path, private=True)


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_secret_file_owner_only_accepted(tmp_path, mode):
    assert P.read_secret_file(_secret(tmp_path, mode), private=True) == SECRET


def test_client_secret_file_only_refuses_world_writable(tmp_path):
    assert P.read_secret_file(_secret(tmp_path, 0o644)) == SECRET  # a client's config: readable is tolerated
    with pytest.raises(EngramflowError, match="has mode 0646, accessible by others"):
        P.read_secret_file(_secret(tmp_path, 0o646, name="w"))


def test_cli_refuses_readable_secret_before_loading(small_ckpt, tmp_path, capsys):
    path = _secret(tmp_path, 0o644)
    assert main(_serve_args(small_ckpt.root, path)) == 2
    _one_line_error(capsys, "mode 0644", str(path))


def test_secret_file_not_regular_or_too_big(tmp_path):
    t = time.monotonic()
    with pytest.raises(EngramflowError, match=r"/dev/zero is not a regular file \(a character device\)"):
        P.read_secret_file("/dev/zero", private=True)
    with pytest.raises(EngramflowError, match="not a regular file"):
        P.read_secret_file("/dev/zero")  # the client side too
    assert time.monotonic() - t < 2  # refused, not read
    with pytest.raises(EngramflowError, match=r"is not a regular file \(a directory\)"):
        P.read_secret_file(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    t = time.monotonic()
    with pytest.raises(EngramflowError, match=r"is not a regular file \(a FIFO\)"):
        P.read_secret_file(fifo, private=True)  # opened non-blocking: no writer needed to fail
    assert time.monotonic() - t < 2
    big = _secret(tmp_path, 0o600, b"x" * (P.MAX_SECRET_FILE + 1), "big")
    with pytest.raises(EngramflowError, match=f"holds {P.MAX_SECRET_FILE + 1} bytes"):
        P.read_secret_file(big, private=True)
    assert P.read_secret_file(_secret(tmp_path, 0o600, b"y" * P.MAX_SECRET_FILE, "max"), private=True)


def test_cli_dev_zero_secret_refused_quickly(small_ckpt, capsys):
    t = time.monotonic()
    assert main(_serve_args(small_ckpt.root, "/dev/zero")) == 2
    assert time.monotonic() - t < 5
    _one_line_error(capsys, "not a regular file")


# -- numeric options --------------------------------------------------------------------------
@pytest.mark.parametrize("flag,value", [
    ("--request-timeout", "inf"), ("--idle-timeout", "inf"), ("--idle-timeout", "nan"), ("--request-timeout", "-inf"),
    ("--idle-timeout", "1e300"), ("--request-timeout", "0"), ("--idle-timeout", "-1"), ("--handshake-timeout", "inf"),
    ("--handshake-timeout", "3600"), ("--max-rows", str(2**40)), ("--max-rows", "0"), ("--max-clients", "0"),
    ("--max-clients", str(10**9)), ("--max-handshakes", "-5"), ("--port", "70000"), ("--port", "-1")])
def test_cli_numbers_finite_positive_bounded(small_ckpt, tmp_path, capsys, flag, value):
    assert main(_serve_args(small_ckpt.root, _secret(tmp_path), f"{flag}={value}")) == 2
    _one_line_error(capsys, flag, "got")


@pytest.mark.parametrize("kw", [{"idle_timeout": float("inf")}, {"request_timeout": float("inf")},
                                {"request_timeout": float("nan")}, {"handshake_timeout": 0},
                                {"max_rows": 2**32}, {"max_clients": 0}, {"max_handshakes": 0}, {"port": 65536}])
def test_server_limits_checked(table, kw):
    with pytest.raises(EngramflowError, match=next(iter(kw))):
        TableServer(np.array(table.codes[:4]), np.array(table.scales[:4]), SECRET, **kw)


# -- unauthenticated connections --------------------------------------------------------------
from test_table_server import _server, table  # noqa: E402,F401  (the same table and server)


def _gather_ok(client, table, ids=(0, 5, 9)):
    ids = np.array(ids)
    assert np.array_equal(client.gather(ids)[0], np.array(table.codes)[ids])


def _closed_within(sock, seconds) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionError, OSError) as e:
        return not isinstance(e, socket.timeout)


def test_pending_handshakes_take_no_client_slot(table):
    s = _server(table, max_clients=1, max_handshakes=3, handshake_timeout=0.5)
    silent = []
    try:
        for _ in range(5):  # silent connections: the pool keeps the newest 3, none takes the client slot
            silent.append(socket.create_connection(s.address, timeout=2))
        with RemoteRamSource(*s.address, SECRET, layer=LAYER, timeout=2, connect_timeout=2) as c:
            _gather_ok(c, table)
            for sock in silent:  # every silent one closed: dropped for a newcomer or past its deadline
                assert _closed_within(sock, 3)
            _gather_ok(c, table)  # the authenticated client is still served
        assert s.stats["handshakes_dropped"] >= 2 and s.stats["timeouts"] >= 1 and s.stats["busy"] == 0
    finally:
        for sock in silent:
            sock.close()
        s.stop()


def test_handshake_deadline_is_short(table):
    s = _server(table, handshake_timeout=0.3, request_timeout=5.0)
    try:
        sock = socket.create_connection(s.address, timeout=2)
        t = time.monotonic()
        assert P.recv_frame(sock, 64)[0] == P.HELLO
        assert _closed_within(sock, 3) and time.monotonic() - t < 2.5
        sock.close()
        assert s.stats["timeouts"] == 1
    finally:
        s.stop()


_FLOOD = textwrap.dedent("""
    import socket, sys, threading, time
    port, n, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    end = time.monotonic() + seconds
    count = [0]
    def flood(i):
        while time.monotonic() < end:
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=1)
            except OSError:
                time.sleep(0.01)
                continue
            count[0] += 1
            try:
                # each holds its connection silently until the server drops it, then reconnects
                s.settimeout(max(0.05, end - time.monotonic()))
                while s.recv(4096):
                    pass
            except OSError:
                pass
            finally:
                s.close()
    ts = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(n)]
    for t in ts: t.start()
    print("started", flush=True)
    for t in ts: t.join(seconds + 5)
    print(count[0], flush=True)
""")


def _start_cli_server(ckpt_root, secret, *extra):
    proc = subprocess.Popen([sys.executable, "-m", "engramflow.cli", *_serve_args(ckpt_root, secret, *extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(proc.communicate(timeout=10)[1])
    return proc, json.loads(line)


def _stop_cli_server(proc) -> tuple[dict, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=10)
    lines = [json.loads(l) for l in out.splitlines() if l.strip()]
    return (lines[-1]["stats"] if lines and "stats" in lines[-1] else {}), err


def test_unauthenticated_flood_does_not_starve_clients(small_ckpt, table, tmp_path):
    """200 unauthenticated clients reconnecting in a loop, each holding its connection silently
    (before: 0 of 131 new clients served): the authenticated client keeps being served, and new
    clients still get in."""
    proc, info = _start_cli_server(small_ckpt.root, _secret(tmp_path),
                                   "--max-clients", "8", "--handshake-timeout", "2")
    flood = kept = None
    try:
        kept = RemoteRamSource(HOST, info["port"], SECRET, layer=LAYER, timeout=5, connect_timeout=5)
        _gather_ok(kept, table)
        flood = subprocess.Popen([sys.executable, "-c", _FLOOD, str(info["port"]), "200", "8"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert flood.stdout.readline().strip() == "started"
        time.sleep(0.5)  # let the flood fill the handshake pool
        served = attempts = 0
        worst = 0.0
        end = time.monotonic() + 5
        while time.monotonic() < end:
            t = time.monotonic()
            _gather_ok(kept, table, np.random.default_rng(attempts).integers(0, table.rows, 48))
            worst = max(worst, time.monotonic() - t)
            attempts += 1
            try:  # a new client: connect, authenticate, gather
                with RemoteRamSource(HOST, info["port"], SECRET, layer=LAYER, timeout=2, connect_timeout=2) as c:
                    _gather_ok(c, table)
                served += 1
            except TierError:
                pass
        flood_out, _ = flood.communicate(timeout=30)
        flood_connections = int(flood_out.split()[-1])
        assert proc.poll() is None
    finally:
        if kept is not None:
            kept.close()
        if flood is not None and flood.poll() is None:
            flood.kill()
            flood.communicate(timeout=10)
        stats, err = _stop_cli_server(proc)
    print(f"new clients served {served}/{attempts}, kept client's worst gather {worst:.3f} s, "
          f"flood connections {flood_connections}, server stats {stats}")
    assert worst < 3.0  # the authenticated client never waits on the flood
    assert attempts >= 3 and served >= max(2, attempts // 3), (served, attempts)
    assert flood_connections > 200 and stats["handshakes_dropped"] + stats["timeouts"] > 0


# -- table files truncated or rewritten under a mapping -----------------------------------------
def _codes_span(ckpt):
    info = ckpt.info(engram_names(LAYER)["embed.weight"])
    return info.file, info.offset, info.nbytes


def test_in_process_table_truncated_is_an_error(tmp_path):
    ckpt = small_checkpoint(tmp_path / "ckpt")
    t = EngramTable(ckpt, LAYER)
    ids = np.arange(2 * t.columns).reshape(2, t.columns)
    ids[1, 0] = t.rows - 1
    before = t.gather(ids)[0].copy()
    t.lookup(ids)
    path, offset, nbytes = _codes_span(ckpt)
    os.truncate(path, offset + nbytes // 2)
    for call in (lambda: t.gather(ids), lambda: t.lookup(ids), lambda: t.warmup(progress=False)):
        with pytest.raises(MappedFileChanged, match="was truncated to .* bytes .* rename"):
            call()
    assert isinstance(MappedFileChanged("x"), EngramflowError)
    with pytest.raises(EngramflowError, match="truncated"):  # a table opened afterwards refuses at once
        EngramTable(ckpt, LAYER)
    assert before.shape == (2, t.columns, t.head_dim)


def test_in_process_table_rewritten_in_place_is_an_error(tmp_path):
    ckpt = small_checkpoint(tmp_path / "ckpt")
    t = EngramTable(ckpt, LAYER)
    t.gather(np.array([3]))
    path, offset, _ = _codes_span(ckpt)
    time.sleep(0.02)  # a distinct mtime even on coarse clocks
    with open(path, "r+b") as f:  # same size, new bytes
        f.seek(offset)
        f.write(b"\xff" * 64)
    with pytest.raises(MappedFileChanged, match="was modified"):
        t.gather(np.array([3]))
    os.truncate(path, 0)  # the error stays (the latch): the mapping is never read again
    with pytest.raises(MappedFileChanged, match="was modified"):
        t.lookup(np.zeros((1, t.columns), np.int64))


def test_read_array_short_file_is_an_error(tmp_path):
    ckpt = small_checkpoint(tmp_path / "ckpt")
    path, offset, nbytes = _codes_span(ckpt)
    a = read_array(path, offset, nbytes, np.uint8, (nbytes,))
    assert np.array_equal(a, np.fromfile(path, np.uint8, nbytes, offset=offset))
    os.truncate(path, offset + 10)
    with pytest.raises(MappedFileChanged, match="truncated"):
        read_array(path, offset, nbytes, np.uint8, (nbytes,))


def test_ram_copy_server_unaffected_by_truncation(tmp_path):
    ckpt = small_checkpoint(tmp_path / "ckpt")
    expect = np.array(EngramTable(ckpt, LAYER).codes[:50])
    s = TableServer.from_checkpoint(ckpt, LAYER, SECRET, port=0).start()
    try:
        path, offset, _ = _codes_span(ckpt)
        os.truncate(path, offset)
        with RemoteRamSource(*s.address, SECRET, layer=LAYER, timeout=2, connect_timeout=2) as c:
            assert np.array_equal(c.gather(np.arange(50))[0], expect)  # served from its pread copy
    finally:
        s.stop()


def test_mmap_server_truncated_shard_answers_errors_and_lives(tmp_path):
    ckpt = small_checkpoint(tmp_path / "ckpt")
    codes = np.array(EngramTable(ckpt, LAYER).codes[:10])
    proc, info = _start_cli_server(ckpt.root, _secret(tmp_path), "--mmap")
    try:
        with RemoteRamSource(HOST, info["port"], SECRET, layer=LAYER, timeout=5, connect_timeout=5) as c:
            assert np.array_equal(c.gather(np.arange(10))[0], codes)
            path, offset, nbytes = _codes_span(ckpt)
            os.truncate(path, offset + nbytes // 3)
            for _ in range(3):  # every request: an error naming the cause; the process stays up
                with pytest.raises(TierError, match="table unavailable: .*was truncated"):
                    c.gather(np.array([info["rows"] - 1, 0]))
                assert proc.poll() is None
        with RemoteRamSource(HOST, info["port"], SECRET, layer=LAYER, timeout=5, connect_timeout=5) as c:
            with pytest.raises(TierError, match="table unavailable"):  # new connections: same answer
                c.gather(np.array([1]))
        assert proc.poll() is None
    finally:
        stats, err = _stop_cli_server(proc)
    assert proc.returncode == 0, err
    assert stats["table_errors"] == 4 and stats["requests"] == 1
    assert err.count("was truncated") == 1, err  # one logged error, not one per request
