"""Running the installed `engramflow` command as a user does: a fresh process, real stderr."""
import os
import subprocess
import sys


def engramflow(*args, cwd=None, timeout=600, env=None) -> subprocess.CompletedProcess:
    environ = os.environ | {"OMP_NUM_THREADS": "1"} | (env or {})
    done = subprocess.run([sys.executable, "-m", "engramflow.cli", *map(str, args)], capture_output=True,
                          cwd=cwd, timeout=timeout, env=environ)
    # decoded here, not with text=True: its newline translation would turn a progress bar's
    # carriage-return redraws into lines of their own
    done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode()
    return done


def stderr_lines(done: subprocess.CompletedProcess) -> list[str]:
    """What a user sees on stderr, line by line (a progress bar's redraws are one line)."""
    return [line.rsplit("\r", 1)[-1] for line in done.stderr.split("\n") if line.strip()]


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """The single stderr line of a refused command (exit 2), with nothing started before it."""
    lines = stderr_lines(done)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in done.stderr, done.stderr
    return lines[0]
