"""Remote-RAM table server and client: bytes, auth, limits, hostile input, killed-server policies."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from engramflow.errors import EngramflowError
from engramflow.memory.tables import EngramTable
from engramflow.tiers import HostMmapSource, Policy, RemoteRamSource, TableServer, TierError, TierStack
from engramflow.tiers import protocol as P
from test_tiers_fixtures import SECRET

LAYER = 1


@pytest.fixture(scope="module")
def table(small_ckpt):
    return EngramTable(small_ckpt, LAYER)


def _server(table, **kw):
    kw = {"port": 0, "max_rows": 1000, "idle_timeout": 5.0, "request_timeout": 1.0, "layer": LAYER} | kw
    return TableServer(np.array(table.codes), np.array(table.scales), SECRET, **kw).start()


@pytest.fixture
def server(table):
    s = _server(table)
    yield s
    s.stop()


def _client(server, secret=SECRET, **kw):
    host, port = server.address
    return RemoteRamSource(host, port, secret, layer=LAYER, **kw)


def _raw(server, secret=SECRET, auth=True) -> socket.socket:
    """A socket past the handshake (or just connected when auth=False)."""
    sock = socket.create_connection(server.address, timeout=2)
    if auth:
        kind, _, nonce = P.recv_frame(sock, 64)
        P.send_frame(sock, P.AUTH, 0, P.mac(secret, "client", bytes(nonce)) + os.urandom(32))
        kind, _, _ = P.recv_frame(sock, 4096)
        assert kind == P.WELCOME
    return sock


def _closed(sock) -> bool:
    """True when the server has closed this connection (after any error frame it sent)."""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except (ConnectionError, OSError):
        return True
    except socket.timeout:
        return False


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    """Until `condition()` holds (a state the server publishes), not a guessed sleep."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.001)


def _still_serves(server, table):
    with _client(server) as c:
        ids = np.array([0, table.rows - 1, 7])
        assert np.array_equal(c.gather(ids)[0], np.array(table.codes)[ids])


def test_remote_bytes_identical_one_message_per_batch(server, table, rng):
    host = HostMmapSource.from_table(table)
    with _client(server) as c:
        assert (c.rows, c.head_dim, c.max_rows) == (table.rows, table.head_dim, 1000)
        for n in (24, 48):
            before = server.stats["requests"]
            ids = rng.integers(0, table.rows, n)
            for a, b in zip(c.gather(ids), host.gather(ids)):
                assert np.array_equal(a, b)
            assert server.stats["requests"] == before + 1
        ids = rng.integers(0, table.rows, 2500)  # over max_rows: split into ceil(2500/1000) messages
        before = server.stats["requests"]
        assert np.array_equal(c.gather(ids)[1], host.gather(ids)[1])
        assert server.stats["requests"] == before + 3


def test_wrong_secret_rejected(server):
    with pytest.raises(TierError, match="refused the connection: authentication failed"):
        _client(server, secret=b"not-the-right-secret-at-all")
    assert server.stats["auth_failures"] == 1
    with pytest.raises(EngramflowError, match="at least 16 bytes"):
        _client(server, secret=b"short")


def test_client_rejects_server_without_secret():
    """An impostor that accepts any client but cannot prove the secret is refused by the client."""
    listener = socket.create_server(("127.0.0.1", 0))

    def impostor():
        conn, _ = listener.accept()
        with conn:
            P.send_frame(conn, P.HELLO, 0, os.urandom(32))
            P.recv_frame(conn, 64)
            P.send_frame(conn, P.WELCOME, 0, os.urandom(32) + P.INFO.pack(10, 32, 1, 100))
            conn.recv(1)

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    try:
        with pytest.raises(TierError, match="does not know the shared secret"):
            RemoteRamSource(*listener.getsockname()[:2], SECRET)
    finally:
        t.join(2)
        listener.close()


def test_out_of_range_ids_rejected(server, table):
    sock = _raw(server)
    try:
        P.send_frame(sock, P.GATHER, 5, np.array([1, table.rows], "<u8"))
        kind, rid, payload = P.recv_frame(sock, 4096)
        assert (kind, rid) == (P.ERROR, 5) and P.parse_error(payload) == (P.E_RANGE, f"row id {table.rows} is outside the table of {table.rows} rows")
        P.send_frame(sock, P.GATHER, 6, np.array([2**64 - 1], "<u8"))  # would be -1 as int64
        kind, _, payload = P.recv_frame(sock, 4096)
        assert kind == P.ERROR and P.parse_error(payload)[0] == P.E_RANGE
        P.send_frame(sock, P.GATHER, 7, np.array([3], "<u8"))  # the connection stays usable
        kind, rid, payload = P.recv_frame(sock, 4096)
        assert (kind, rid) == (P.ROWS, 7) and bytes(payload[:table.head_dim]) == table.codes[3].tobytes()
    finally:
        sock.close()
    with _client(server) as c:  # through the client: a TierError naming the id, connection kept
        with pytest.raises(TierError, match=f"row id {table.rows + 9} is outside"):
            c._gather(np.array([table.rows + 9], np.int64))
        assert c._sock is not None and c.gather(np.array([1]))[0].shape == (1, table.head_dim)
        many = np.arange(48, dtype=np.int64)
        many[40] = table.rows + 1  # a reply buffer bigger than the error frame
        with pytest.raises(TierError, match=f"row id {table.rows + 1} is outside"):
            c._gather(many)
        assert np.array_equal(c.gather(np.arange(48))[0], np.array(table.codes)[:48])
    assert server.stats["range_errors"] == 4


def test_hostile_input_does_not_crash_server(server, table):
    rng = np.random.default_rng(11)
    for i in range(12):  # random bytes before and after authentication
        sock = _raw(server, auth=bool(i % 2))
        sock.settimeout(2)
        try:
            sock.sendall(rng.integers(0, 256, int(rng.integers(1, 3000)), dtype=np.uint8).tobytes())
            assert _closed(sock)
        except (ConnectionError, OSError):
            pass
        finally:
            sock.close()
    # oversized: a header claiming 2 GiB, and a GATHER just over max_rows; neither is read
    for length in (2**31, 8 * 1001):
        sock = _raw(server)
        sock.sendall(P.HEADER.pack(P.MAGIC, P.VERSION, P.GATHER, 1, length))
        kind, _, payload = P.recv_frame(sock, 4096)
        assert kind == P.ERROR and P.parse_error(payload)[0] == P.E_TOO_LARGE
        assert _closed(sock)
        sock.close()
    # oversized AUTH before the handshake, a wrong frame type, a truncated request that stalls
    sock = _raw(server, auth=False)
    P.recv_frame(sock, 64)
    sock.sendall(P.HEADER.pack(P.MAGIC, P.VERSION, P.AUTH, 0, 10**9))
    assert _closed(sock)
    sock = _raw(server)
    P.send_frame(sock, P.ROWS, 1, b"abcdefgh")
    assert P.recv_frame(sock, 4096)[0] == P.ERROR and _closed(sock)
    sock = _raw(server)
    sock.sendall(P.HEADER.pack(P.MAGIC, P.VERSION, P.GATHER, 1, 80) + b"\0" * 8)
    t = time.monotonic()
    assert _closed(sock) and time.monotonic() - t < 1.9  # request_timeout (1 s) closes it
    assert server.stats["malformed"] >= 6 and server.stats["too_large"] == 2 and server.stats["timeouts"] >= 1
    _still_serves(server, table)


def test_many_concurrent_clients(server, table):
    codes = np.array(table.codes)
    errors = []

    def work(seed):
        r = np.random.default_rng(seed)
        try:
            with _client(server) as c:
                for _ in range(15):
                    ids = r.integers(0, table.rows, 48)
                    assert np.array_equal(c.gather(ids)[0], codes[ids])
        except Exception as e:  # noqa: BLE001 - collected and reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and server.stats["requests"] >= 8 * 15


def test_idle_timeout_and_client_cap(table):
    s = _server(table, idle_timeout=0.3, max_clients=2)
    try:
        a, b = _raw(s), _raw(s)
        c = socket.create_connection(s.address, timeout=2)
        kind, _, payload = P.recv_frame(c, 4096)
        assert kind == P.ERROR and P.parse_error(payload)[0] == P.E_BUSY
        c.close()
        a.settimeout(2)
        assert _closed(a)  # idle past 0.3 s: closed, freeing a slot
        b.close()
        _wait_for(lambda: s._active < 2)  # the server has seen b go: a slot is free
        _still_serves(s, table)
        assert s.stats["busy"] == 1
    finally:
        s.stop()


def test_idle_longer_than_request_timeout_keeps_connection(table):
    s = _server(table, idle_timeout=3.0, request_timeout=0.2)
    try:
        with _client(s) as c:
            c.gather(np.array([1]))
            time.sleep(0.5)  # idle past request_timeout, within idle_timeout
            c.gather(np.array([2]))
            assert s.stats["connections"] == 1 and s.stats["timeouts"] == 0
    finally:
        s.stop()


def test_client_reconnects_after_server_idle_close(table):
    s = _server(table, idle_timeout=0.2)
    try:
        with _client(s) as c:
            c.gather(np.array([1]))
            time.sleep(0.5)  # the server drops the idle connection
            assert np.array_equal(c.gather(np.array([3]))[0], np.array(table.codes)[[3]])
            assert s.stats["connections"] == 2 and c.stats["errors"] == 0
    finally:
        s.stop()


@pytest.mark.parametrize("mode", ["fallback", "retry", "reject"])
def test_killed_server_triggers_policy(table, mode, rng):
    s = _server(table)
    remote = _client(s, timeout=0.5, connect_timeout=0.5)
    host = HostMmapSource.from_table(table)
    policy = Policy(mode, retries=2, backoff_s=0.001) if mode == "retry" else Policy(mode)
    stack = TierStack([(remote, policy), (host, "reject")], LAYER)
    ids = rng.integers(0, table.rows, 48)
    expect = host.gather(ids)
    assert np.array_equal(stack.gather(ids)[0], expect[0]) and remote.stats["requests"] == 1
    s.stop()
    if mode == "fallback":
        for a, b in zip(stack.gather(ids), expect):
            assert np.array_equal(a, b)
        assert remote.stats["fallbacks"] == 1 and remote.stats["errors"] == 1
    else:
        with pytest.raises(TierError, match=f"tier 'remote' failed after {policy.attempts} attempt.*policy {mode}"):
            stack.gather(ids)
        assert remote.stats["errors"] == policy.attempts and remote.stats["rejects"] == 1
        assert remote.stats["retries"] == (2 if mode == "retry" else 0)
    remote.close()


def test_retry_reconnects_to_restarted_server(table, rng):
    s = _server(table)
    port = s.address[1]
    remote = RemoteRamSource("127.0.0.1", port, SECRET, timeout=0.5, connect_timeout=0.5)
    stack = TierStack([(remote, Policy("retry", retries=4, backoff_s=0.05, backoff_max_s=0.2))])
    ids = rng.integers(0, table.rows, 24)
    stack.gather(ids)
    s.stop()
    holder = {}
    restart = threading.Timer(0.06, lambda: holder.setdefault("s", _server(table, port=port)))
    restart.start()
    try:
        assert np.array_equal(stack.gather(ids)[0], np.array(table.codes)[ids])
        assert remote.stats["retries"] >= 1
    finally:
        restart.join()
        holder["s"].stop()
        remote.close()


def test_cli_server_killed_falls_back(small_ckpt, table, tmp_path, rng):
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    secret_file.chmod(0o600)  # the server refuses a secret file others can read
    proc = subprocess.Popen([sys.executable, "-m", "engramflow.cli", "serve-table", "--checkpoint",
                             str(small_ckpt.root), "--layer", str(LAYER), "--port", "0", "--secret-file", str(secret_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        info = json.loads(line)
        assert info["host"] == "127.0.0.1" and info["rows"] == table.rows
        remote = RemoteRamSource("127.0.0.1", info["port"], SECRET, table.rows, table.head_dim, LAYER, timeout=0.5)
        host = HostMmapSource.from_table(table)
        stack = TierStack([(remote, "fallback"), (host, "reject")], LAYER)
        ids = rng.integers(0, table.rows, 48)
        assert np.array_equal(stack.gather(ids)[0], host.gather(ids)[0]) and remote.stats["fallbacks"] == 0
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        for a, b in zip(stack.gather(ids), host.gather(ids)):
            assert np.array_equal(a, b)
        assert remote.stats["fallbacks"] == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)
        proc.stdout.close()
        proc.stderr.close()


def test_cli_rejects_bad_secret_file(small_ckpt, tmp_path):
    (tmp_path / "s").write_bytes(b"short\n")
    (tmp_path / "s").chmod(0o600)  # refused for its length, not its mode
    from engramflow.cli.app import main
    assert main(["serve-table", "--checkpoint", str(small_ckpt.root), "--layer", "1", "--port", "0",
                 "--secret-file", str(tmp_path / "s")]) == 2
    assert main(["serve-table", "--checkpoint", str(small_ckpt.root), "--layer", "1", "--port", "0",
                 "--secret-file", str(tmp_path / "nope")]) == 2
