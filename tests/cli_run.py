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


class ReachedRay(AssertionError):
    """A command checked in process went on to start or join Ray instead of refusing first."""


def engramflow_here(*args, env=None) -> subprocess.CompletedProcess:
    """The command through the CLI's `main()` in this process, as `engramflow()` reports it
    (exit status, stdout, stderr), for a refusal that comes before Ray: the same parser, checks
    and one-line message without a fresh interpreter (seconds each). Every path to Ray
    (`ensure_ray`, `ray.init`) raises ReachedRay while it runs, so a check that moved behind
    Ray's start fails here as the "no starting line" check fails in a fresh process. What a
    fresh process adds (the interpreter's own stderr, Ray's start-up lines) stays with the
    tests that run one (test_cli_quiet.py, test_hardening_cli.py's pipes)."""
    import importlib

    import ray

    def refuse(*a, **kw):
        raise ReachedRay(f"`engramflow {' '.join(map(str, args))}` reached Ray before refusing")

    modules = [importlib.import_module(m) for m in ("engramflow.pipeline.ray_address", "engramflow.pipeline.launch",
                                                    "engramflow.data.access.stats", "engramflow.data.prefill.job")]
    patched = [(m, "ensure_ray", m.ensure_ray) for m in modules] + [(ray, "init", ray.init)]
    for owner, name, _ in patched:
        setattr(owner, name, refuse)
    try:
        return engramflow_in_process(*args, env=env)
    finally:
        for owner, name, real in patched:
            setattr(owner, name, real)


def engramflow_in_process(*args, env=None, cwd=None) -> subprocess.CompletedProcess:
    """`engramflow ARGS` through the CLI's `main()` in this process (in `cwd`), reported as
    `engramflow()` reports a fresh process; the environment and working folder are restored.
    A command that needs Ray uses this process's (the test session's instance) and its kept
    actors, as a command run in a notebook would."""
    import contextlib
    import io

    from engramflow.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    saved_env, home = dict(os.environ), os.getcwd()
    os.environ.update({"OMP_NUM_THREADS": "1"} | (env or {}))
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in args])
    finally:
        os.chdir(home)
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["engramflow", *map(str, args)], code, out.getvalue(), err.getvalue())
