"""`engramflow serve` as a process of its own for the serving benchmarks: started with the given
options on a port, its URL read from the JSON line it prints once it listens, stopped with
SIGINT as a user would."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engramflow.cli.signals import interrupt


class Server:
    def __init__(self, ckpt: Path, stages: int, port: int, options: list[str]):
        cmd = [str(Path(sys.executable).parent / "engramflow"), "serve", "--checkpoint", str(ckpt), "--stages",
               str(stages), "--port", str(port), *options]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("{"):
            self.stop()
            raise RuntimeError(f"the server did not start ({' '.join(cmd)})")
        self.url = json.loads(line)["listening"]

    def stop(self) -> None:
        interrupt(self.proc)
