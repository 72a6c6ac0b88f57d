"""Remote-RAM tier: a client of the table server (server.py), one message per table per batch.

All rows a request needs go out in one GATHER frame and come back in one ROWS frame (split only
at the server's max_rows), so a token costs one round trip per table, never one per row.
The connection is opened lazily and dropped on any fault; the next gather reconnects, which is
what the `retry` policy relies on. Faults raise TierUnavailable / TierError for the policy.
"""
from __future__ import annotations

import hmac
import os
import socket
import threading

import numpy as np

from engramflow.errors import EngramflowError
from engramflow.tiers import protocol as P
from engramflow.tiers.source import RowStore, TierError, TierUnavailable
from engramflow.tiers.stats import TierStats


class RemoteRamSource(RowStore):
    """Rows from a table server at host:port. `rows`/`head_dim`, when given, are checked against
    the server's; when omitted the client connects now to learn them."""

    def __init__(self, host: str, port: int, secret: bytes, rows: int | None = None, head_dim: int | None = None,
                 layer: int | None = None, timeout: float = 1.0, connect_timeout: float = 1.0, name: str = "remote"):
        self.host, self.port = host, int(port)
        self.secret = P.check_secret(secret)
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.layer, self.name = layer, name
        self.stats = TierStats(name, layer)
        self._lock = threading.Lock()  # one request in flight per connection
        self._sock: socket.socket | None = None
        self._rid = 0
        self._head = memoryview(bytearray(P.HEADER.size))  # reply headers land here
        self.max_rows = 1 << 16
        self.rows, self.head_dim = rows, head_dim
        if rows is None or head_dim is None:
            with self._lock:
                self._connect()

    def _connect(self) -> socket.socket:
        where = f"table server {self.host}:{self.port}"
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except OSError as e:
            raise TierUnavailable(f"{where}: cannot connect: {e.strerror or e}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # else Nagle adds ~40 ms
            P.set_socket_timeouts(sock, send_s=self.timeout)
            reader = P.FrameReader(sock, self.timeout, self.timeout)
            kind, _, nonce = reader.frame(P.NONCE)
            if kind != P.HELLO or len(nonce) != P.NONCE:
                raise P.ProtocolError("expected HELLO")
            mine = os.urandom(P.NONCE)
            P.send_frame(sock, P.AUTH, 0, P.mac(self.secret, "client", bytes(nonce)) + mine)
            kind, _, payload = reader.frame(4096)
            if kind == P.ERROR:
                code, text = P.parse_error(payload)
                raise TierError(f"{where} refused the connection: {text}")
            if kind != P.WELCOME or len(payload) != P.MAC + P.INFO.size:
                raise P.ProtocolError("expected WELCOME")
            if not hmac.compare_digest(bytes(payload[:P.MAC]), P.mac(self.secret, "server", mine)):
                raise TierError(f"{where} does not know the shared secret (server proof failed)")
            rows, head_dim, layer, max_rows = P.INFO.unpack_from(payload, P.MAC)
        except TierError:
            sock.close()
            raise
        except (OSError, ConnectionError, P.ProtocolError) as e:
            sock.close()
            raise TierUnavailable(f"{where}: handshake failed: {e}") from None
        if (self.rows, self.head_dim) not in ((None, None), (rows, head_dim)) or \
                (self.layer is not None and layer not in (-1, self.layer)):
            sock.close()
            raise EngramflowError(f"{where} serves layer {layer} with {rows} rows x {head_dim}, expected layer "
                                  f"{self.layer} with {self.rows} x {self.head_dim}")
        self.rows, self.head_dim, self.max_rows = rows, head_dim, max_rows
        self._sock = sock
        return sock

    def _gather(self, ids):
        with self._lock:
            if ids.size <= self.max_rows:  # the usual case: one message, reply arrays are views
                return self._request_kept(ids)
            codes = np.empty((ids.size, self.head_dim), np.uint8)
            scales = np.empty((ids.size, self.scale_dim), np.uint8)
            for a in range(0, ids.size, self.max_rows):  # split only past the server's limit
                c, s = self._request_kept(ids[a:a + self.max_rows])
                codes[a:a + c.shape[0]], scales[a:a + c.shape[0]] = c, s
            return codes, scales

    def _request_kept(self, ids):
        if self._sock is None:
            return self._request(self._connect(), ids)
        try:
            return self._request(self._sock, ids)
        except TierUnavailable:
            # a kept connection may have been closed by the server's idle timeout while unused:
            # gathers are idempotent, so reconnect once before reporting a fault
            return self._request(self._connect(), ids)

    def _request(self, sock, ids):
        """One GATHER round trip. The reply is read straight into the two result arrays (one
        recvmsg_into scattering header, codes and scales), so a whole reply usually costs one
        syscall and no copy, and the arrays belong to the caller."""
        rid = self._rid = (self._rid + 1) & 0xFFFFFFFF
        n, d, sd = ids.size, self.head_dim, self.scale_dim
        size = n * (d + sd)
        codes, scales = np.empty((n, d), np.uint8), np.empty((n, sd), np.uint8)
        head = self._head
        try:
            sock.sendall(_HEAD_PACK(P.MAGIC, P.VERSION, P.GATHER, rid, 8 * n) + ids.astype("<u8", copy=False).tobytes())
            got = _recv_into(sock, [head, codes, scales])
            while got < _HSIZE:
                got += _recv_into(sock, [head[got:], codes, scales])
            magic, version, kind, rrid, length = _HEAD_UNPACK(head)
            if magic != P.MAGIC or version != P.VERSION:
                raise P.ProtocolError("bad frame header")
            if kind != P.ROWS or rrid != rid or length != size:
                if kind == P.ERROR and length <= 4096:
                    self._error(sock, rid, rrid, length, got, codes, scales)
                raise P.ProtocolError(f"unexpected reply (type {kind}, id {rrid}, {length} bytes)")
            total = _HSIZE + size
            if got < total:
                cv, sv = codes.data.cast("B"), scales.data.cast("B")
                while got < total:
                    k = got - _HSIZE
                    got += _recv_into(sock, [cv[k:], sv] if k < n * d else [sv[k - n * d:]])
        except (OSError, ConnectionError, TimeoutError, P.ProtocolError) as e:
            self._drop()
            raise TierUnavailable(f"table server {self.host}:{self.port}: {e or type(e).__name__}") from None
        return codes, scales

    def _error(self, sock, rid, rrid, length, got, codes, scales):
        """An ERROR reply: its payload may have landed (partly) in the row arrays."""
        have = (codes.tobytes() + scales.tobytes())[:min(got - _HSIZE, length)]
        if len(have) < length:
            have += bytes(P.recv_exact(sock, length - len(have)))
        code, msg = P.parse_error(have)
        if rrid != rid:
            raise P.ProtocolError("reply to another request")
        if code != P.E_RANGE:  # anything else ends the connection on the server's side
            self._drop()
        raise TierError(f"table server {self.host}:{self.port}: {msg}")

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()


_HEAD_PACK, _HEAD_UNPACK, _HSIZE = P.HEADER.pack, P.HEADER.unpack, P.HEADER.size


def _recv_into(sock, buffers) -> int:
    try:
        k = sock.recvmsg_into(buffers)[0]
    except BlockingIOError:  # SO_RCVTIMEO fired
        raise TimeoutError("timed out waiting for the table server") from None
    if k == 0:
        raise ConnectionError("connection closed by the table server")
    return k
