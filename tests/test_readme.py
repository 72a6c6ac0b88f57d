"""Every code block of the README runs, in order, from a fresh-clone state: a folder that holds
nothing but what the blocks before made (the blocks make their own checkpoints; `{ckpt}` is the
small V4.1 checkpoint `make demo` makes, standing in for the released one). How each block is
run is in the README itself, next to it (tests/readme_blocks.py). Python blocks, and the
`engramflow` commands of a bash block that is plain commands (no pipes, redirections or
variables), run in this process, in the clone's folder: the commands through the CLI's `main()`
with the arguments a shell would pass. They use the session's Ray, whose kept actors
(pipeline/actor_pool.py) spare a launch its processes' start, as a notebook's would. Other bash
blocks, and a plain block's other commands, run in a shell. A fresh `engramflow` process (the
console script, its own Ray, what it prints) is test_cli_quiet.py's and test_cluster_yaml.py's."""
import contextlib
import io
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cli_run import engramflow_in_process
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
    commands = plain_commands(code)
    for words in commands or [["bash", "-euo", "pipefail", "-c", code]]:
        if words[0] == "engramflow":
            done = engramflow_in_process(*words[1:], cwd=clone)
        else:
            done = subprocess.run(words, cwd=clone, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"README line {block.line}:\n{code}\n--- ran {words}\n--- stdout\n" \
                                     f"{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"


def plain_commands(code: str) -> list[list[str]] | None:
    """The block's commands as the argument lists a shell would run (one per line, or joined by
    `&&`), or None when it uses more of the shell than that (pipes, redirections, `;`,
    variables, globs): such a block runs in a shell."""
    commands = []
    for line in code.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = []
        for token in lexer:
            if token == "&&":
                commands.append(words)
                words = []
            elif set(token) & set("();<>|&$`*?~{}[]!"):
                return None
            else:
                words.append(token)
        commands.append(words)
    return [words for words in commands if words] or None


def run_here(code: str, cwd: Path, line: int) -> None:
    """Run a Python block here with `cwd` as the working folder; its traceback names the line."""
    home = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, f"README.md line {line}", "exec"), {"__name__": "__readme__"})
    finally:
        os.chdir(home)
