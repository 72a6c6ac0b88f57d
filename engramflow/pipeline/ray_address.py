"""Starting or joining Ray (`ensure_ray`, the one place that calls ray.init; a local instance
listens on loopback only), and refusing a
Ray address where no Ray cluster answers, in bounded time and before anything is built
(ray.init itself retries for tens of seconds and prints its own log lines)."""
from __future__ import annotations

import os
import re
import socket
import threading

from engramflow.errors import EngramflowError

RAY_PROBE_TIMEOUT_S = 5.0
_HOST_PORT = re.compile(r"(?:ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")
_GCS_PING = "/ray.rpc.NodeInfoGcsService/GetClusterId"  # what ray.init asks a GCS first
_HTTP_STATUS = {8: 200, 9: 204, 10: 206, 11: 304, 12: 400, 13: 404, 14: 500}  # HPACK static table
# the HTTP/2 client preface and an empty SETTINGS frame: every gRPC server (the Ray GCS, the Ray
# client server) answers with a SETTINGS frame; anything else at that port is not Ray
_H2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _frame(ftype: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([ftype, flags]) + stream.to_bytes(4, "big") + payload


def _hpack_literal(name_index: int, value: str) -> bytes:
    """A header field 'literal without indexing, indexed name' (RFC 7541 §6.2.2), plain string."""
    def integer(v: int, bits: int) -> bytes:
        limit = (1 << bits) - 1
        if v < limit:
            return bytes([v])
        out, v = [limit], v - limit
        while v >= 128:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        return bytes(out + [v])

    raw = value.encode()
    return integer(name_index, 4) + integer(len(raw), 7) + raw


def _gcs_request(authority: str) -> bytes:
    """A gRPC GetClusterId call (an empty message) on stream 1, to follow the HTTP/2 preface:
    the smallest thing a Ray GCS answers."""
    block = (b"\x83\x86"  # :method POST, :scheme http
             + _hpack_literal(4, _GCS_PING) + _hpack_literal(1, authority)
             + _hpack_literal(31, "application/grpc") + b"\x00\x02te\x08trailers")
    return _frame(1, 0x4, 1, block) + _frame(0, 0x1, 1, b"\x00" * 5)


def _judge_headers(flags: int, payload: bytes) -> str | None:
    """The answer to the GetClusterId call: None if it can be a Ray GCS, else why not. Only a
    plainly encoded refusal counts: an HTTP status other than 200 (a proxy, a web server) or
    gRPC UNIMPLEMENTED (some other gRPC service). Anything not understood passes."""
    if flags & 0x8:  # PADDED
        payload = payload[1:len(payload) - payload[0]] if payload else b""
    if flags & 0x20:  # PRIORITY
        payload = payload[5:]
    while payload and payload[0] & 0xE0 == 0x20 and payload[0] != 0x3F:  # dynamic table size updates
        payload = payload[1:]
    if payload and payload[0] & 0x80:
        status = _HTTP_STATUS.get(payload[0] & 0x7F)
        if status not in (None, 200):
            return f"the server there answered HTTP {status}: not a Ray GCS (a proxy in the way?)"
    if b"grpc-status\x0212" in payload:
        return "the gRPC server there is not a Ray GCS"
    return None


def _probe(host: str, port: int, timeout_s: float, gcs: bool = True, tls: bool = False) -> str | None:
    """None if a Ray GCS answers at host:port (gcs=False: any gRPC server, e.g. the Ray client
    server), else why not (one line). Every socket call times out after `timeout_s`."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            if tls:  # a TLS cluster: the handshake is Ray's to do; reachable is all we check
                return None
            sock.sendall(_H2_HELLO + (_gcs_request(f"{host}:{port}") if gcs else b""))
            buf = b""
            while True:
                while len(buf) < 9 or len(buf) < 9 + int.from_bytes(buf[:3], "big"):
                    more = sock.recv(65536)
                    if not more:
                        raise ConnectionAbortedError
                    buf += more
                    if len(buf) >= 9 and buf[3] > 9:
                        break  # not an HTTP/2 frame at all (e.g. 'HTTP/1.1 400 ...')
                n, ftype, flags = int.from_bytes(buf[:3], "big"), buf[3], buf[4]
                if len(buf) < 9 + n or ftype > 9:
                    return "the server there does not speak gRPC: not a Ray port?"
                stream, payload, buf = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF, buf[9:9 + n], buf[9 + n:]
                if ftype == 4 and not flags & 0x1:  # the server's SETTINGS: it speaks HTTP/2
                    if not gcs:
                        return None
                    sock.sendall(_frame(4, 0x1, 0))  # acknowledge them, as a client must
                elif ftype == 1 and stream == 1:  # the answer to our call
                    return _judge_headers(flags, payload)
                elif ftype == 7 or (ftype == 3 and stream == 1):  # GOAWAY or RST_STREAM
                    return "the server there refused a Ray request: not a Ray GCS?"
    except socket.gaierror as e:
        return f"unknown host {host!r} ({e.strerror})"
    except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
        return "the connection was closed without an answer: not a Ray port?"
    except (socket.timeout, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    except OSError as e:
        return e.strerror or str(e)


def check_ray_address(address: str | None, timeout_s: float = RAY_PROBE_TIMEOUT_S) -> None:
    """Refuse, in bounded time and before anything is built, an --address where no Ray cluster
    answers: a malformed one at once, an unknown host, a closed or silent port, or a port of
    something that is not a Ray GCS (asked for its cluster id over HTTP/2, as ray.init does
    first) within about `timeout_s`. None and "local" start a local instance;
    "auto" is resolved as Ray resolves it (RAY_ADDRESS, then the last `ray start`)."""
    if address is None or address == "local":
        return
    target = address
    if address == "auto" or os.environ.get("RAY_ADDRESS"):
        try:
            from ray._private.services import canonicalize_bootstrap_address_or_die

            target = canonicalize_bootstrap_address_or_die(address)
        except ConnectionError as e:
            raise EngramflowError(f"cannot reach Ray at {address!r}: {e}") from None
        except Exception:  # Ray's private resolver changed or failed: leave it to ray.init
            return
    m = _HOST_PORT.fullmatch(target.strip())
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise EngramflowError(f"Ray address {address!r} is not auto, local or HOST:PORT "
                              "(e.g. 10.0.0.5:6379 or ray://10.0.0.5:10001)")
    host, port = m.group(1).strip("[]"), int(m.group(2))
    tls = os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")
    client = target.strip().startswith("ray://")  # the Ray client server: gRPC, but no GCS service
    result: list[str | None] = []
    # a thread bounds name resolution too (getaddrinfo takes no timeout)
    t = threading.Thread(target=lambda: result.append(_probe(host, port, timeout_s, gcs=not client, tls=tls)),
                         daemon=True)
    t.start()
    t.join(timeout_s + 1)
    reason = result[0] if result else f"no answer within {timeout_s:g} s"
    if reason is not None:
        raise EngramflowError(f"cannot reach Ray at {address!r}"
                              + (f" ({target})" if target != address else "") + f": {reason}")


LOOPBACK = "127.0.0.1"


def bind_local_ray_to_loopback() -> None:
    """Make the local Ray instance this process starts listen on 127.0.0.1 only: its GCS,
    raylet, object manager, workers, agents and the Prometheus metrics exporter all bind the
    node address (the exporter binds loopback only when that address is loopback). Ray turns a
    loopback `_node_ip_address` into the machine's routable address unless its single-machine
    mode is on (the default on macOS and Windows): switched on here for this process (its
    constant is read at import) and for Ray's own processes (through the environment, which they
    inherit). A cluster joined with --address is left as its operator configured it."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def init_local_ray(num_cpus: int | None = None) -> None:
    """Start a local Ray instance bound to loopback (no dashboard; workers' logs to files)."""
    import ray

    bind_local_ray_to_loopback()
    ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False,
             configure_logging=False, _node_ip_address=LOOPBACK, dashboard_host=LOOPBACK)


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Join the Ray at `address` (default: $RAY_ADDRESS when set, as ray.init reads it), or start
    a local one (with `num_cpus`, default every core) unless Ray is already up in this process.
    True when this call started or joined it (the caller then shuts it down when done). Workers'
    log lines stay in Ray's log files: the driver's stderr carries engramflow's own messages."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None  # as ray.init reads it
    try:
        if address is None:
            init_local_ray(num_cpus)
        else:
            check_ray_address(address)  # fail in seconds, not after ray.init's retries
            ray.init(address=address, log_to_driver=False)
    except EngramflowError:
        raise
    except Exception as e:  # ConnectionError, RuntimeError, ValueError, Ray's own (e.g. authentication)
        raise EngramflowError(f"cannot start or reach Ray at {address or 'a new local instance'!r}: {e}") from None
    return True
