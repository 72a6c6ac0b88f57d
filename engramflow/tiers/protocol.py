"""Wire format of the remote-RAM table server (client and server share it).

Every message is a frame: a 12-byte header `<2sBBII` (magic b"EF", version, type, request id,
payload bytes) and the payload. A connection starts with a mutual HMAC-SHA256
challenge-response over random nonces, so the secret never crosses the wire and a recorded
exchange cannot be replayed:

    server -> HELLO   nonce_s (32)
    client -> AUTH    HMAC(secret, "client" + nonce_s) (32) + nonce_c (32)
    server -> WELCOME HMAC(secret, "server" + nonce_c) (32) + rows u64, head_dim u32, layer i32, max_rows u32
            or ERROR and close
then any number of
    client -> GATHER  row ids, u64 little-endian (one message per table per token batch)
    server -> ROWS    codes [N, D] then scales [N, D/32], raw bytes   |   ERROR code u16 + utf-8 text
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import stat
import struct
import time

from engramflow.errors import EngramflowError
from engramflow.validate import check_int

MAGIC, VERSION = b"EF", 1
HEADER = struct.Struct("<2sBBII")
INFO = struct.Struct("<QIiI")
NONCE = MAC = 32

HELLO, AUTH, WELCOME, GATHER, ROWS, ERROR = 1, 2, 3, 4, 5, 6
E_AUTH, E_TOO_LARGE, E_RANGE, E_MALFORMED, E_BUSY, E_TABLE = 1, 2, 3, 4, 5, 6
ERROR_NAMES = {E_AUTH: "authentication failed", E_TOO_LARGE: "request too large", E_RANGE: "row id out of range",
               E_MALFORMED: "malformed request", E_BUSY: "server busy",
               E_TABLE: "table unavailable (its file changed on disk)"}
_CLIENT, _SERVER = b"engramflow-table/client", b"engramflow-table/server"
MIN_SECRET = 16
MAX_SECRET_FILE = 4096  # a secret file is a few dozen bytes; more is a mistake (or /dev/zero)
MAX_TIMEOUT = 86400.0  # seconds: every timeout is finite and at most a day (kernel timevals overflow)


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame: the connection must be dropped."""


def mac(secret: bytes, side: str, nonce: bytes) -> bytes:
    # the side label makes a client proof useless as a server proof (no reflection)
    return hmac.new(secret, (_CLIENT if side == "client" else _SERVER) + nonce, hashlib.sha256).digest()


def check_secret(secret: bytes, where: str = "secret") -> bytes:
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET:
        n = len(secret) if isinstance(secret, (bytes, bytearray)) else type(secret).__name__
        raise EngramflowError(f"{where}: the shared secret must be at least {MIN_SECRET} bytes, got {n}")
    return bytes(secret)


def read_secret_file(path, private: bool = False) -> bytes:
    """The secret file's bytes, trailing newline stripped (so `openssl rand -hex 32 > F` works).

    Only a regular file of at most MAX_SECRET_FILE bytes is read (not a FIFO, a device such as
    /dev/zero, or a directory), and never one that others may write (anyone could then choose
    the secret). `private` (the server) also refuses a file that group or others can access,
    as ssh does with private keys; the message names the mode.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO must not block
    except OSError as e:
        raise EngramflowError(f"cannot read secret file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)  # of the opened file: no check-then-open race
        if not stat.S_ISREG(st.st_mode):
            raise EngramflowError(f"secret file {path} is not a regular file ({_file_kind(st.st_mode)})")
        mode = stat.S_IMODE(st.st_mode)
        bad = mode & (0o077 if private else 0o002)
        if bad:
            who = "group or others" if private else "others"
            raise EngramflowError(
                f"secret file {path} has mode {mode:04o}, accessible by {who} "
                f"({stat.filemode(st.st_mode)}); run: chmod 600 {path}")
        if st.st_size > MAX_SECRET_FILE:
            raise EngramflowError(f"secret file {path} holds {st.st_size} bytes, more than the "
                                  f"{MAX_SECRET_FILE} a secret file may hold")
        chunks, left = [], MAX_SECRET_FILE + 1  # bounded even if the file grows while read
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    except OSError as e:
        raise EngramflowError(f"cannot read secret file {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_FILE:
        raise EngramflowError(f"secret file {path} holds more than the {MAX_SECRET_FILE} bytes a secret file may hold")
    return check_secret(data.rstrip(b"\r\n"), f"secret file {path}")


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_seconds(value, name: str, lo: float = 1e-3, hi: float = MAX_TIMEOUT) -> float:
    """A finite timeout in [lo, hi] seconds, else EngramflowError naming `name` (inf, nan, 0,
    negatives and absurd values would overflow the kernel's timeval or never fire)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise EngramflowError(f"{name} must be a finite number of seconds in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def check_count(value, name: str, lo: int, hi: int) -> int:
    """An integer limit in [lo, hi], else EngramflowError naming `name`."""
    return check_int(name, value, lo, hi)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k
    return buf


def recv_header(sock: socket.socket) -> tuple[int, int, int]:
    """(type, request id, payload bytes); ProtocolError on a bad magic or version."""
    magic, version, kind, rid, length = HEADER.unpack(recv_exact(sock, HEADER.size))
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"bad frame header (magic {magic!r}, version {version})")
    return kind, rid, length


def recv_frame(sock: socket.socket, max_payload: int) -> tuple[int, int, bytearray]:
    kind, rid, length = recv_header(sock)
    if length > max_payload:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {max_payload}")
    return kind, rid, recv_exact(sock, length)


def send_frame(sock: socket.socket, kind: int, rid: int, *parts) -> None:
    """Header and payload parts (bytes or contiguous arrays) in one sendmsg: one packet when small."""
    if len(parts) == 1 and memoryview(parts[0]).nbytes < 4096:
        # small single payload (requests): one copy is cheaper than building an iovec list
        payload = parts[0] if isinstance(parts[0], (bytes, bytearray)) else parts[0].tobytes()
        sock.sendall(HEADER.pack(MAGIC, VERSION, kind, rid, len(payload)) + payload)
        return
    views = [memoryview(p).cast("B") for p in parts]
    total = sum(v.nbytes for v in views)
    head = HEADER.pack(MAGIC, VERSION, kind, rid, total)
    sent = sock.sendmsg([head, *views])
    if sent < len(head) + total:  # large replies: finish with sendall on what is left
        rest = b"".join([head, *views])[sent:]
        sock.sendall(rest)


def error_payload(code: int, text: str) -> bytes:
    return struct.pack("<H", code) + text.encode()[:1000]


def parse_error(payload: bytes) -> tuple[int, str]:
    if len(payload) < 2:
        return E_MALFORMED, "malformed error reply"
    return struct.unpack_from("<H", payload)[0], bytes(payload[2:]).decode(errors="replace")


def set_socket_timeouts(sock: socket.socket, recv_s: float | None = None, send_s: float | None = None) -> None:
    """Blocking socket with kernel timeouts (SO_RCVTIMEO/SO_SNDTIMEO).

    Python's own socket timeouts poll() before every recv/send: one extra syscall per call on
    the latency path. Kernel timeouts cost nothing until they fire (then EAGAIN: BlockingIOError).
    """
    sock.settimeout(None)
    for opt, sec in ((socket.SO_RCVTIMEO, recv_s), (socket.SO_SNDTIMEO, send_s)):
        if sec is not None:
            sock.setsockopt(socket.SOL_SOCKET, opt, _timeval(sec))


def _timeval(sec: float) -> bytes:
    # 0 would mean "never time out"; inf/nan/huge would overflow the struct (callers check
    # their timeouts with check_seconds; this clamp only keeps a stray value from raising here)
    sec = min(max(sec, 1e-3), MAX_TIMEOUT) if sec == sec else MAX_TIMEOUT
    return struct.pack("ll", int(sec), int((sec % 1) * 1e6))


class FrameReader:
    """Reads frames with as few recv calls as possible: one, when a whole frame is in the socket.

    Bytes past the current frame stay buffered for the next one. While no frame is pending the
    socket waits up to `idle_s`; once a frame has started, the rest must come within `request_s`
    in total (a trickling sender cannot hold the connection).
    """

    def __init__(self, sock: socket.socket, idle_s: float, request_s: float, capacity: int = 1 << 16):
        self.sock, self.idle_s, self.request_s = sock, idle_s, request_s
        self.buf = bytearray(capacity)
        self._view = memoryview(self.buf)  # kept: no new memoryview per recv
        self.start = self.end = 0
        self._deadline = None
        self._rcvtimeo = idle_s
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(idle_s))

    def _timeout(self, sec: float) -> None:
        if sec != self._rcvtimeo:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(sec))
            self._rcvtimeo = sec

    def _fill(self, deadline: float | None) -> None:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("request not completed in time")
            self._timeout(min(left, self.request_s))
        try:
            k = self.sock.recv_into(self._view[self.end:] if self.end else self._view)
        except BlockingIOError:
            raise TimeoutError("timed out waiting for the peer") from None
        if k == 0:
            raise ConnectionError("connection closed by peer")
        self.end += k

    def _room(self, need: int) -> None:
        """Make the buffer able to hold `need` bytes from `start`."""
        if self.start + need <= len(self.buf):
            return
        n = self.end - self.start
        new = bytearray(max(need, len(self.buf)))  # fresh buffer: views of the old one stay valid
        new[:n] = self._view[self.start:self.end]
        self.buf, self._view, self.start, self.end = new, memoryview(new), 0, n

    def header(self) -> tuple[int, int, int]:
        """(type, request id, payload bytes) of the next frame; its payload is not read yet."""
        deadline = None
        if self.end - self.start < HEADER.size:  # else: the whole header is buffered already
            if self.end == self.start:  # nothing pending (the usual case): one recv, waiting up to idle_s
                self.start = self.end = 0
                self._fill(None)
            self._room(HEADER.size)
            while self.end - self.start < HEADER.size:
                if deadline is None:  # a frame has started: the rest is due within request_s
                    deadline = time.monotonic() + self.request_s
                self._fill(deadline)
        magic, version, kind, rid, length = HEADER.unpack_from(self.buf, self.start)
        if magic != MAGIC or version != VERSION:
            raise ProtocolError(f"bad frame header (magic {magic!r}, version {version})")
        self._deadline = deadline
        return kind, rid, length

    def payload(self, length: int) -> memoryview:
        """The current frame's payload (valid until the next read); call after header()."""
        start = self.start
        need = HEADER.size + length
        deadline = self._deadline
        if self.end - start < need:
            self._room(need)
            start = self.start
            while self.end - start < need:
                if deadline is None:
                    deadline = time.monotonic() + self.request_s
                self._fill(deadline)
        view = self._view[start + HEADER.size: start + need]
        start += need
        if start == self.end:
            self.start = self.end = 0
        else:
            self.start = start
        if deadline is not None:
            self._timeout(self.idle_s)
        return view

    def frame(self, max_payload: int) -> tuple[int, int, memoryview]:
        kind, rid, length = self.header()
        if length > max_payload:
            raise ProtocolError(f"frame of {length} bytes exceeds the limit of {max_payload}")
        return kind, rid, self.payload(length)
