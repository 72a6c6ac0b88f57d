"""Remote-RAM table server: one Engram table held in RAM, served over the binary protocol.

One thread per authenticated connection (requests are tiny and the gather releases little; a
thread keeps a client's latency independent of the others). Hardening, because anything that
can reach the port can talk to it:
* binds loopback unless told otherwise; every connection must pass the HMAC handshake first;
* connections that have not authenticated yet cost no thread and no client slot: the accept
  thread runs every handshake itself (non-blocking, one selector) in a pool of its own of
  `max_handshakes`, each with a short deadline (`handshake_timeout`). When the pool is full the
  oldest pending handshake is dropped for the newcomer once it has had MIN_HANDSHAKE_AGE to
  answer (until then newcomers wait, in order, in the kernel's accept queue). So a flood of
  unauthenticated connections (even hundreds reconnecting in a loop) can neither take the
  slots of authenticated clients (`max_clients`, which keep being served) nor keep a new
  client that answers the challenge within MIN_HANDSHAKE_AGE from getting in: it waits its
  turn in the queue (about flood size x MIN_HANDSHAKE_AGE / max_handshakes seconds);
* frames are size-limited (max_rows ids per request) and row ids are bounds-checked before
  any read, so no request can read outside the table;
* idle and per-request timeouts, all finite and bounded, and a cap on concurrent clients;
* anything malformed closes that connection only; the accept loop never sees client errors;
* a table served from a checkpoint mapping (`copy=False`) is checked (one fstat) before every
  gather: a file truncated or rewritten in place gives the client an E_TABLE error and the
  server one logged error, not a SIGBUS (memory/safe_mmap.py documents the remaining window);
  the default RAM copy is read with pread and is immune.
"""
from __future__ import annotations

import collections
import hmac
import logging
import os
import selectors
import socket
import threading
import time

import numpy as np

from engramflow.errors import EngramflowError
from engramflow.tiers import protocol as P

log = logging.getLogger(__name__)

MAX_ROWS = 1 << 20  # ids per request at most (an 8 MiB request, a 264 MiB reply)
MAX_CLIENTS = 4096
_AUTH_BYTES = P.HEADER.size + P.MAC + P.NONCE
MIN_HANDSHAKE_AGE = 0.1  # seconds: ample for a client to answer the challenge (one round trip)
_ACCEPT_BURST = 64  # accepts per wake-up before pending handshakes get a turn


class _Pending:
    __slots__ = ("nonce", "born", "deadline", "buf")

    def __init__(self, nonce: bytes, born: float, deadline: float):
        self.nonce, self.born, self.deadline, self.buf = nonce, born, deadline, bytearray()


class TableServer:
    def __init__(self, codes: np.ndarray, scales: np.ndarray, secret: bytes, host: str = "127.0.0.1",
                 port: int = 0, layer: int | None = None, max_rows: int = 1 << 16,
                 idle_timeout: float = 60.0, request_timeout: float = 5.0, max_clients: int = 64,
                 max_handshakes: int = 64, handshake_timeout: float = 2.0, table_check=None):
        if codes.ndim != 2 or scales.shape != (codes.shape[0], codes.shape[1] // 32):
            raise EngramflowError(f"codes {list(codes.shape)} and scales {list(scales.shape)} are not one table")
        self.max_rows = P.check_count(max_rows, "max_rows", 1, MAX_ROWS)
        self.max_clients = P.check_count(max_clients, "max_clients", 1, MAX_CLIENTS)
        self.max_handshakes = P.check_count(max_handshakes, "max_handshakes", 1, MAX_CLIENTS)
        self.idle_timeout = P.check_seconds(idle_timeout, "idle_timeout")
        self.request_timeout = P.check_seconds(request_timeout, "request_timeout")
        self.handshake_timeout = P.check_seconds(handshake_timeout, "handshake_timeout", hi=60.0)
        # a pending handshake is not dropped for a newcomer before this age (see _accept)
        self._min_age = min(MIN_HANDSHAKE_AGE, self.handshake_timeout / 2)
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise EngramflowError(f"port must be in [0, 65535], got {port!r}")
        self.codes, self.scales = codes, scales
        self.rows, self.head_dim = codes.shape
        self.secret = P.check_secret(secret)
        self.layer = layer
        self._table_check = table_check  # raises EngramflowError once the mapped file changed
        self._active = 0  # authenticated connections (threads)
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = dict.fromkeys(("connections", "auth_failures", "requests", "rows", "range_errors",
                                    "malformed", "too_large", "busy", "timeouts", "handshakes_dropped",
                                    "table_errors"), 0)
        try:
            self._sock = socket.create_server((host, port), backlog=1024)  # the kernel caps it at somaxconn
        except OSError as e:
            raise EngramflowError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        self.address = self._sock.getsockname()[:2]

    @classmethod
    def from_checkpoint(cls, ckpt, layer: int, secret: bytes, copy: bool = True, **kw) -> "TableServer":
        """Serve a checkpoint's table. `copy` (the default) reads it into anonymous RAM with pread
        (no page-cache eviction, and nothing that happens to the file later can reach it); else it
        serves the warmed checkpoint mapping, checked before every gather."""
        from engramflow.io.checkpoint import engram_names
        from engramflow.memory.safe_mmap import read_array
        from engramflow.memory.tables import EngramTable
        if copy:
            names = engram_names(layer)
            infos = [ckpt.info(names[k]) for k in ("embed.weight", "embed.scale")]
            codes, scales = (read_array(i.file, i.offset, i.nbytes, np.uint8, i.shape) for i in infos)
            return cls(codes, scales, secret, layer=layer, **kw)
        t = EngramTable(ckpt, layer)
        t.warmup(progress=False)
        return cls(t.codes, t.scales, secret, layer=layer, table_check=t._guard.check, **kw)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "TableServer":
        self._thread = threading.Thread(target=self.serve_forever, name="table-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Accept connections and run their handshakes (one thread, one selector); an
        authenticated connection gets a thread of its own (`_serve_conn`)."""
        sel = selectors.DefaultSelector()
        pending: collections.OrderedDict[socket.socket, _Pending] = collections.OrderedDict()  # oldest first
        try:
            self._sock.setblocking(False)
            sel.register(self._sock, selectors.EVENT_READ, None)
        except (OSError, ValueError):
            sel.close()
            return  # stopped before it started
        listening = True
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if not listening and (len(pending) < self.max_handshakes or self._evictable(pending, now)):
                    try:
                        sel.register(self._sock, selectors.EVENT_READ, None)
                    except (OSError, ValueError):
                        break  # stop() closed it
                    listening = True
                wait = 0.2  # wake up to notice stop()
                if pending:
                    oldest = next(iter(pending.values()))
                    wait = min(wait, max(0.0, oldest.deadline - now))
                    if not listening:
                        wait = min(wait, max(0.0, oldest.born + self._min_age - now))
                try:
                    events = sel.select(wait)
                except OSError:
                    if self._stop.is_set():
                        break
                    continue
                accept = False
                for key, _ in events:  # handshakes first: a pending AUTH is read before anyone is evicted
                    if key.data is None:
                        accept = True
                    else:
                        self._advance(sel, pending, key.fileobj, key.data)
                if accept:
                    listening = self._accept(sel, pending)
                now = time.monotonic()
                while pending:  # deadlines are in accept order: expire from the front
                    conn, hs = next(iter(pending.items()))
                    if hs.deadline > now:
                        break
                    self._count("timeouts")
                    self._forget(sel, pending, conn)
        finally:
            for conn in list(pending):
                self._forget(sel, pending, conn)
            sel.close()

    def _evictable(self, pending, now: float) -> bool:
        """The oldest pending handshake has had its minimum time and may make room."""
        return now - next(iter(pending.values())).born >= self._min_age

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

    # -- handshakes (accept thread only) -----------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    def _accept(self, sel, pending) -> bool:
        """Accept what is queued (a bounded burst). When the handshake pool is full, the oldest
        pending handshake makes room, but only once it has had `_min_age` to answer; until then
        the listener is paused (False: unregistered) and newcomers wait in the kernel's queue, in
        order. So a flood cannot cycle the pool faster than max_handshakes per _min_age, and
        every accepted client gets at least that long to authenticate."""
        for _ in range(_ACCEPT_BURST):
            if len(pending) >= self.max_handshakes:
                if not self._evictable(pending, time.monotonic()):
                    try:
                        sel.unregister(self._sock)
                    except (KeyError, ValueError, OSError):
                        pass
                    return False
                self._count("handshakes_dropped")
                self._forget(sel, pending, next(iter(pending)))
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:  # e.g. EMFILE, or stop() closed the socket: keep serving the clients we have
                if not self._stop.is_set():
                    time.sleep(0.01)  # (the listener stays readable: do not spin)
                return True
            conn.setblocking(False)
            if self._active >= self.max_clients:  # (read without the lock: a hint, rechecked after AUTH)
                self._count("busy")
                _reject(conn, 0, P.E_BUSY, "too many clients")
                continue
            self._count("connections")
            nonce = os.urandom(P.NONCE)
            if not _send_now(conn, P.HEADER.pack(P.MAGIC, P.VERSION, P.HELLO, 0, P.NONCE) + nonce):
                _shutdown(conn)
                continue
            now = time.monotonic()
            hs = _Pending(nonce, now, now + self.handshake_timeout)
            sel.register(conn, selectors.EVENT_READ, hs)
            pending[conn] = hs
        return True

    def _forget(self, sel, pending, conn, close: bool = True) -> None:
        pending.pop(conn, None)
        try:
            sel.unregister(conn)
        except (KeyError, ValueError, OSError):
            pass
        if close:
            _shutdown(conn)

    def _advance(self, sel, pending, conn, hs) -> None:
        """Read what has come of the AUTH frame; act on it once whole. Reads no byte past it."""
        if conn not in pending:
            return  # dropped earlier in this round
        try:
            data = conn.recv(_AUTH_BYTES - len(hs.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._forget(sel, pending, conn)
            return
        if not data:
            self._forget(sel, pending, conn)
            return
        hs.buf += data
        if len(hs.buf) >= P.HEADER.size:
            magic, version, kind, rid, length = P.HEADER.unpack_from(hs.buf)
            if magic != P.MAGIC or version != P.VERSION or kind != P.AUTH or length != P.MAC + P.NONCE:
                self._count("malformed")
                self._forget(sel, pending, conn)
                return
        if len(hs.buf) < _AUTH_BYTES:
            return
        self._forget(sel, pending, conn, close=False)
        payload = bytes(hs.buf[P.HEADER.size:])
        if not hmac.compare_digest(payload[:P.MAC], P.mac(self.secret, "client", hs.nonce)):
            self._count("auth_failures")
            _reject(conn, rid, P.E_AUTH, "authentication failed")
            return
        with self._lock:
            full = self._active >= self.max_clients
            if not full:
                self._active += 1
                self._conns.add(conn)
        if full:
            self._count("busy")
            _reject(conn, rid, P.E_BUSY, "too many clients")
            return
        proof = P.mac(self.secret, "server", payload[P.MAC:])
        info = P.INFO.pack(self.rows, self.head_dim, -1 if self.layer is None else self.layer, self.max_rows)
        body = proof + info
        if not _send_now(conn, P.HEADER.pack(P.MAGIC, P.VERSION, P.WELCOME, rid, len(body)) + body):
            self._release(conn)
            return
        try:
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()
        except RuntimeError:  # cannot start a thread: turn this client away, keep serving
            self._release(conn)

    # -- one authenticated connection (its own thread) ---------------------------------------
    def _release(self, conn) -> None:
        with self._lock:
            self._conns.discard(conn)
            self._active -= 1
        _shutdown(conn)

    def _serve_conn(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            P.set_socket_timeouts(conn, send_s=self.request_timeout)  # blocking; a client that stops reading is dropped
            reader = P.FrameReader(conn, self.idle_timeout, self.request_timeout)
            self._loop(conn, reader)
        except (TimeoutError, socket.timeout, BlockingIOError):
            self._count("timeouts")
        except P.ProtocolError:
            self._count("malformed")
        except (OSError, ConnectionError):
            pass  # client went away
        finally:
            self._release(conn)

    def _table_failed(self, conn, rid, err) -> None:
        with self._lock:
            first = self.stats["table_errors"] == 0
            self.stats["table_errors"] += 1
        if first:  # once: every later request gets the same answer
            log.error("table server (layer %s): %s", self.layer, err)
        P.send_frame(conn, P.ERROR, rid, P.error_payload(P.E_TABLE, f"table unavailable: {err}"))

    def _loop(self, conn, reader) -> None:
        # the hot path: locals only, one recv (the reader's) and one sendmsg per request
        header, payload, stopped = reader.header, reader.payload, self._stop.is_set
        codes_src, scales_src, nrows, max_bytes = self.codes, self.scales, self.rows, 8 * self.max_rows
        pack, sendmsg, stats, lock = P.HEADER.pack, conn.sendmsg, self.stats, self._lock
        i64, table_check = np.dtype("<i8"), self._table_check
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
            if table_check is not None:  # a mapped table: its file must still be whole
                try:
                    table_check()
                except EngramflowError as e:
                    self._table_failed(conn, rid, e)
                    continue
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


def _send_now(conn: socket.socket, data: bytes) -> bool:
    """Send a small frame on a non-blocking socket without waiting: True if it all went out."""
    try:
        return conn.send(data) == len(data)
    except OSError:
        return False


def _reject(conn: socket.socket, rid: int, code: int, text: str) -> None:
    conn.setblocking(False)  # never wait on a client here: this runs on the accept thread
    _send_now(conn, _error_frame(rid, code, text))
    _shutdown(conn)


def _error_frame(rid: int, code: int, text: str) -> bytes:
    payload = P.error_payload(code, text)
    return P.HEADER.pack(P.MAGIC, P.VERSION, P.ERROR, rid, len(payload)) + payload


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        conn.close()
    except OSError:
        pass
