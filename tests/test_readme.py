"""Every code block of the README runs, in order, from a fresh-clone state: a folder that holds
nothing but what the blocks before made (the blocks make their own checkpoints; `{ckpt}` is the
small V4.1 checkpoint `make demo` makes, standing in for the released one). How each block is
run is in the README itself, next to it (tests/readme_blocks.py). Bash blocks run in a shell;
Python blocks in this process, in the clone's folder: on the session's Ray, whose kept actors
(pipeline/actor_pool.py) spare a launch its processes' start, as a notebook's would."""
import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from readme_blocks import blocks

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = blocks(ROOT / "README.md")

pytestmark = pytest.mark.slow  # several blocks start Ray (the pipeline, generate, access-stats)


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """The working folder of a fresh clone: empty (no checkpoints/)."""
    return tmp_path_factory.mktemp("fresh-clone")


def small_v41(clone: Path) -> Path:
    path = clone / "checkpoints" / "v41-small"
    if not (path / "config.json").is_file():  # made by `make demo` when the blocks run in order
        from engramflow.model.synth import make_checkpoint

        make_checkpoint("v41-small", path, progress=False)
    return path


def test_every_example_kind_is_covered():
    assert {b.lang for b in BLOCKS} == {"python", "bash"} and len(BLOCKS) >= 9
    assert not any("checkpoints/tiny" in b.code for b in BLOCKS if b.lang == "python" and b.line <
                   next(c.line for c in BLOCKS if "make-checkpoint --preset tiny" in c.code))


@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{b.line}-{b.lang}" for b in BLOCKS])
def test_readme_block_runs(block, clone, request, join_env):
    values = {"root": ROOT}
    subs = "".join(new for _, new in block.subs)
    if "{ckpt}" in subs:
        values["ckpt"] = small_v41(clone)
    if "{url}" in subs:  # a client example: against the test session's real `engramflow serve` process
        server = request.getfixturevalue("serve_server")
        values |= {"url": server.url, "key": server.key, "model": "tiny"}
    code = block.runnable(**values)
    if block.lang == "python":
        run_here(code, clone, block.line)
        return
    # RAY_ADDRESS: a block that starts Ray (address=None, no --address) joins the session's
    # instance, as Ray's own ray.init() would; starting one is test_cli_quiet.py's
    env = join_env | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"README line {block.line}:\n{code}\n--- stdout\n{done.stdout[-3000:]}\n" \
                                 f"--- stderr\n{done.stderr[-3000:]}"


def run_here(code: str, cwd: Path, line: int) -> None:
    """Run a Python block here with `cwd` as the working folder; its traceback names the line."""
    home = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, f"README.md line {line}", "exec"), {"__name__": "__readme__"})
    finally:
        os.chdir(home)
