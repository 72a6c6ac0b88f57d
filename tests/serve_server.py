"""One real `engramflow serve` process for the serving tests (a session fixture in conftest),
and what the tests need around it: the in-process Engine's tokens for the same request, and
the server's own processes (to kill a stage actor)."""
from __future__ import annotations

import json
import os
import secrets
import select
import subprocess
import sys
import time
from pathlib import Path

from engramflow.cli.signals import interrupt

PREFILL_CHUNK = 16
MAX_SESSIONS = 34
MAX_QUEUE = 3
BACKBONE = "reference"


class Server:
    def __init__(self, ckpt: Path, workdir: Path, extra: tuple[str, ...] = (), stages: int = 2,
                 backbone: str | None = BACKBONE, model: str = "tiny"):
        self.key = secrets.token_hex(16)
        key_file = workdir / "api.key"
        key_file.write_text(self.key + "\n")
        key_file.chmod(0o600)
        self.port = free_port()
        exe = Path(sys.executable).parent / "engramflow"
        cmd = [str(exe), "serve", "--checkpoint", str(ckpt), "--stages", str(stages), "--prefill-chunk", str(PREFILL_CHUNK),
               "--port", str(self.port), "--max-sessions", str(MAX_SESSIONS), "--max-queue", str(MAX_QUEUE),
               "--api-key-file", str(key_file), "--model", model, *extra]
        cmd += ["--backbone", backbone] if backbone else []
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        self.log = open(workdir / "server.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, env=env, text=True)
        self.url = self._wait_listening()

    def _wait_listening(self, timeout: float = 240.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith("{"):
                    return json.loads(line)["listening"]
        self.stop()
        self.log.seek(0)
        raise RuntimeError(f"the server did not start: {self.log.read()[-3000:]}")

    def descendants(self) -> list[tuple[int, str]]:
        """(pid, command line) of every process under the server (its Ray and actors)."""
        children: dict[int, list[int]] = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(d.name))
        out, todo = [], [self.proc.pid]
        while todo:
            for c in children.get(todo.pop(), []):
                try:
                    out.append((c, (Path("/proc") / str(c) / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
                except OSError:
                    continue
                todo.append(c)
        return out

    def stop(self) -> None:
        interrupt(self.proc)


class ServeApp:
    """`engramflow serve`'s application (its options parsed and checked by the command's own
    parser and `_config`) run with `serve.run` on the test session's shared Ray instance (the
    `serve_http` fixture), in place of a server process of its own: the same HTTP API, the same
    replica, pipeline and key; what a process adds (its Ray, its signals, its JSON line) is the
    session server's to test (`Server` above, the `serve_server` fixture)."""

    def __init__(self, http: str, ckpt: Path, workdir: Path, name: str, extra: tuple[str, ...] = (), stages: int = 2,
                 backbone: str | None = BACKBONE, model: str = "tiny"):
        from ray import serve

        from engramflow.cli.app import build_parser
        from engramflow.cli.serve import _config
        from engramflow.serve.deployment import application

        self.key = secrets.token_hex(16)
        key_file = workdir / "api.key"
        key_file.write_text(self.key + "\n")
        key_file.chmod(0o600)
        argv = ["serve", "--checkpoint", str(ckpt), "--stages", str(stages), "--prefill-chunk", str(PREFILL_CHUNK),
                "--max-sessions", str(MAX_SESSIONS), "--max-queue", str(MAX_QUEUE), "--api-key-file", str(key_file),
                "--model", model, *extra] + (["--backbone", backbone] if backbone else [])
        cfg = _config(build_parser().parse_args(argv))
        self.name = name
        serve.run(application(cfg), name=name, route_prefix=f"/{name}")
        self.url = f"{http}/{name}"

    def stop(self) -> None:
        from ray import serve

        if self.name is not None:  # once: conftest may stop the app before the session ends
            serve.delete(self.name)
            self.name = None


# Ports for test servers come from below Linux's ephemeral range (32768-60999) and above Ray's
# worker ports (10002-19999). A port the kernel hands out for bind(0) lies in the ephemeral range,
# where any process's next outgoing connection (Ray opens many) may take it before the server
# binds it: CI once lost the session's Serve proxy that way ("Failed to bind to address").
TEST_PORTS = range(20000, 32768)


def free_port() -> int:
    """A loopback port nothing listens on now, drawn at random from TEST_PORTS."""
    import random
    import socket

    for _ in range(100):
        port = random.choice(TEST_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {TEST_PORTS}")
