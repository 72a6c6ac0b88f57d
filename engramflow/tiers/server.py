"""Remote-RAM table server: one Engram table held in RAM, served over the binary protocol.

One thread per connection (requests are tiny and the gather releases little; a thread keeps a
client's latency independent of the others). Hardening, because anything that can reach the
port can talk to it:
* binds loopback unless told otherwise; every connection must pass the HMAC handshake first;
* frames are size-limited (max_rows ids per request) and row ids are bounds-checked before
  any read, so no request can read outside the table;
* idle and per-request timeouts, and a cap on concurrent clients;
* anything malformed closes that connection only; the accept loop never sees client errors.
"""
from __future__ import annotations

import hmac
import os
import socket
import threading

import numpy as np

from engramflow.errors import EngramflowError
from engramflow.tiers import protocol as P


class TableServer:
    def __init__(self, codes: np.ndarray, scales: np.ndarray, secret: bytes, host: str = "127.0.0.1",
                 port: int = 0, layer: int | None = None, max_rows: int = 1 << 16,
                 idle_timeout: float = 60.0, request_timeout: float = 5.0, max_clients: int = 64):
        if codes.ndim != 2 or scales.shape != (codes.shape[0], codes.shape[1] // 32):
            raise EngramflowError(f"codes {list(codes.shape)} and scales {list(scales.shape)} are not one table")
        if not 1 <= max_rows <= (1 << 32) - 1 or max_clients < 1 or idle_timeout <= 0 or request_timeout <= 0:
            raise EngramflowError(f"bad server limits: max_rows={max_rows}, max_clients={max_clients}, "
                                  f"idle_timeout={idle_timeout}, request_timeout={request_timeout}")
        self.codes, self.scales = codes, scales
        self.rows, self.head_dim = codes.shape
        self.secret = P.check_secret(secret)
        self.layer, self.max_rows = layer, max_rows
        self.idle_timeout, self.request_timeout = idle_timeout, request_timeout
        self._slots = threading.BoundedSemaphore(max_clients)
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = dict.fromkeys(("connections", "auth_failures", "requests", "rows", "range_errors",
                                    "malformed", "too_large", "busy", "timeouts"), 0)
        try:
            self._sock = socket.create_server((host, port), backlog=128)
        except OSError as e:
            raise EngramflowError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        self.address = self._sock.getsockname()[:2]

    @classmethod
    def from_checkpoint(cls, ckpt, layer: int, secret: bytes, copy: bool = True, **kw) -> "TableServer":
        """Serve a checkpoint's table; `copy` loads it into anonymous RAM (no page-cache eviction)."""
        from engramflow.memory.tables import EngramTable
        t = EngramTable(ckpt, layer)
        if copy:
            return cls(np.array(t.codes), np.array(t.scales), secret, layer=layer, **kw)
        t.warmup(progress=False)
        return cls(t.codes, t.scales, secret, layer=layer, **kw)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "TableServer":
        self._thread = threading.Thread(target=self.serve_forever, name="table-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._sock.settimeout(0.2)  # wake up to notice stop()
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                if self._stop.is_set():
                    break
                continue  # e.g. EMFILE: keep serving the clients we have
            if not self._slots.acquire(blocking=False):
                self._count("busy")
                self._reject(conn, P.E_BUSY, "too many clients")
                continue
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            for c in list(self._conns):
                _shutdown(c)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- one connection ----------------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    def _reject(self, conn, code, text) -> None:
        try:
            conn.settimeout(0.5)
            P.send_frame(conn, P.ERROR, 0, P.error_payload(code, text))
        except OSError:
            pass
        _shutdown(conn)

    def _serve_conn(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.add(conn)
            self.stats["connections"] += 1
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            P.set_socket_timeouts(conn, send_s=self.request_timeout)  # a client that stops reading is dropped
            # the handshake must finish within request_timeout; then idle_timeout between requests
            reader = P.FrameReader(conn, self.request_timeout, self.request_timeout)
            if self._handshake(conn, reader):
                reader.set_idle(self.idle_timeout)
                self._loop(conn, reader)
        except (TimeoutError, socket.timeout, BlockingIOError):
            self._count("timeouts")
        except P.ProtocolError:
            self._count("malformed")
        except (OSError, ConnectionError):
            pass  # client went away
        finally:
            with self._lock:
                self._conns.discard(conn)
            _shutdown(conn)
            self._slots.release()

    def _handshake(self, conn, reader) -> bool:
        nonce = os.urandom(P.NONCE)
        P.send_frame(conn, P.HELLO, 0, nonce)
        kind, rid, payload = reader.frame(P.MAC + P.NONCE)
        if kind != P.AUTH or len(payload) != P.MAC + P.NONCE:
            raise P.ProtocolError("expected AUTH")
        if not hmac.compare_digest(bytes(payload[:P.MAC]), P.mac(self.secret, "client", nonce)):
            self._count("auth_failures")
            P.send_frame(conn, P.ERROR, rid, P.error_payload(P.E_AUTH, "authentication failed"))
            return False
        proof = P.mac(self.secret, "server", bytes(payload[P.MAC:]))
        info = P.INFO.pack(self.rows, self.head_dim, -1 if self.layer is None else self.layer, self.max_rows)
        P.send_frame(conn, P.WELCOME, rid, proof + info)
        return True

    def _loop(self, conn, reader) -> None:
        # the hot path: locals only, one recv (the reader's) and one sendmsg per request
        header, payload, stopped = reader.header, reader.payload, self._stop.is_set
        codes_src, scales_src, nrows, max_bytes = self.codes, self.scales, self.rows, 8 * self.max_rows
        pack, sendmsg, stats, lock = P.HEADER.pack, conn.sendmsg, self.stats, self._lock
        i64 = np.dtype("<i8")
        while not stopped():
            kind, rid, length = header()
            if kind != P.GATHER or length % 8:
                self._count("malformed")
                P.send_frame(conn, P.ERROR, rid, P.error_payload(P.E_MALFORMED, f"bad request type {kind} / size {length}"))
                return
            if length > max_bytes:
                self._count("too_large")  # do not read it: close instead of draining an attacker's bytes
                P.send_frame(conn, P.ERROR, rid, P.error_payload(
                    P.E_TOO_LARGE, f"request of {length // 8} rows exceeds the limit of {self.max_rows}"))
                return
            body = payload(length)
            # bounds check with the builtin max over the u64 view: on a request's cold path it is
            # cheaper than a numpy reduction (unsigned: nothing wraps around)
            if length and max(body.cast("Q")) >= nrows:
                ids = np.frombuffer(body, dtype="<u8")
                self._count("range_errors")
                bad = int(ids[ids >= nrows][0])
                P.send_frame(conn, P.ERROR, rid, P.error_payload(
                    P.E_RANGE, f"row id {bad} is outside the table of {nrows} rows"))
                continue  # a well-formed request with a bad id: answer it, keep the connection
            rows = np.frombuffer(body, dtype=i64)  # all < nrows, so the signed view is exact
            codes, scales = codes_src.take(rows, axis=0), scales_src.take(rows, axis=0)
            del rows, body  # releases the reader's buffer view before the next read
            size = codes.nbytes + scales.nbytes
            with lock:  # counted before replying, so a client that got its rows sees the count
                stats["requests"] += 1
                stats["rows"] += codes.shape[0]
            head = pack(P.MAGIC, P.VERSION, P.ROWS, rid, size)
            sent = sendmsg((head, codes, scales))
            if sent < P.HEADER.size + size:  # large replies: finish with sendall on what is left
                conn.sendall(b"".join((head, codes.data.cast("B"), scales.data.cast("B")))[sent:])


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        conn.close()
    except OSError:
        pass
