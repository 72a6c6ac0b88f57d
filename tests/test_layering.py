"""The package's imports go one way, and its files stay small:

    kernels -> io -> memory -> tiers -> model -> actors -> scheduling -> pipeline -> {data, profiling} -> cli

Each package may import only packages to its left (and the base modules errors, sessions,
timeline, validate, which import nothing above them). No cycle between files either. Every
import counts, the lazy ones inside functions too. No file in engramflow/ is over MAX_LINES
lines, except the ones named in LONG_FILES with the reason.
"""
import ast
from pathlib import Path

import engramflow

ORDER = ["kernels", "io", "memory", "tiers", "model", "actors", "scheduling", "pipeline", "data", "profiling", "cli"]
ORDER[ORDER.index("io"):ORDER.index("io")] = ["chat"]  # the chat format imports nothing of the package
ORDER[ORDER.index("io"):ORDER.index("io")] = ["structured"]  # grammars over the chat format's tokens
ORDER[ORDER.index("cli"):ORDER.index("cli")] = ["serve"]  # the server: on the pipeline, under the CLI
RANK = {name: i for i, name in enumerate(ORDER)}
RANK["profiling"] = RANK["serve"] = RANK["data"]  # side by side: none imports another
BASE = {"engramflow", "engramflow.errors", "engramflow.sessions", "engramflow.timeline", "engramflow.validate"}
MAX_LINES = 300
LONG_FILES: dict[str, str] = {  # path under engramflow/ -> why it is one file
    "tiers/server.py": "the table server's accept loop, handshake pool and client threads share one "
                       "lock and one set of limits; split, the hardening rules would be read in pieces",
    "tiers/config.py": "the tier schema (every key, its type and its check) is one table a user reads top "
                       "to bottom; the stores it builds are a few lines each",
    "kernels/native_build.py": "the one loader of the three C libraries: build, cache, ABI and freshness "
                               "checks and load share one spec and one fallback order, and setup.py loads "
                               "it by path with the standard library only, so it cannot lean on a sibling",
    "kernels/projection.py": "the two projection regimes (decode GEMV, prefill tiles) and the choice "
                             "between them read as one algorithm",
}
ROOT = Path(engramflow.__file__).parent


def modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the engramflow modules it imports (`from pkg import sub` names the submodule)."""
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "engramflow":
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
                deps.update(subs or [node.module])
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == "engramflow")
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def package(module: str) -> str | None:
    parts = module.split(".")
    return None if module in BASE else parts[1]


def test_every_package_is_in_the_order():
    packages = {package(m) for m in modules()} - {None}
    assert packages <= set(RANK), packages - set(RANK)


def test_imports_follow_the_layer_order():
    bad = []
    for src, deps in imports(modules()).items():
        for dst in deps:
            ps, pd = package(src), package(dst)
            if ps is None:
                ok = pd is None  # base modules import only base modules
            else:
                ok = pd is None or pd == ps or RANK[pd] < RANK[ps]
            if not ok:
                bad.append(f"{src} -> {dst}")
    assert not bad, "imports against the layer order:\n" + "\n".join(sorted(bad))


def test_no_import_cycle_between_files():
    graph = imports(modules())
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_only_the_model_package_imports_a_model_family():
    """Generic packages see a model through model/'s own modules (backbones.py, vision.py,
    speculative.py), never model/v41/ itself: another model family plugs in behind them."""
    bad = [f"{src} -> {dst}" for src, deps in imports(modules()).items() for dst in deps
           if dst.startswith("engramflow.model.v41") and package(src) != "model"]
    assert not bad, "generic code importing model/v41:\n" + "\n".join(sorted(bad))


def test_actors_import_plain_classes_not_the_pipeline():
    graph = imports(modules())
    for src, deps in graph.items():
        if package(src) == "actors":
            assert not any(package(d) in ("pipeline", "data", "profiling", "cli") for d in deps), src


def test_readme_layout_names_every_package():
    """The README's layout block lists exactly the package's subpackages (and the order line
    names the same ones)."""
    import re

    readme = (ROOT.parent / "README.md").read_text()
    section = readme[readme.index("## Layout"):]
    listed = set(re.findall(r"^  ([a-z_]+)/\s", section, flags=re.M))
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert listed == packages, (sorted(listed ^ packages))
    order_line = re.search(r"^kernels -> .*$", section, flags=re.M).group(0)
    assert set(re.findall(r"[a-z]+", order_line)) == packages


def test_no_file_is_over_the_line_limit():
    long = {str(f.relative_to(ROOT)): n for f in ROOT.rglob("*.py")
            if (n := len(f.read_text().splitlines())) > MAX_LINES}
    unexplained = {f: n for f, n in long.items() if f not in LONG_FILES}
    assert not unexplained, f"files over {MAX_LINES} lines (split them, or name them in LONG_FILES): {unexplained}"
    stale = set(LONG_FILES) - set(long)
    assert not stale, f"LONG_FILES names files no longer over the limit: {sorted(stale)}"


def test_tests_readme_names_every_test_file():
    """tests/README.md says what each test file covers: a new file gets its line."""
    tests = ROOT.parent / "tests"
    listed = (tests / "README.md").read_text()
    missing = sorted(f.name for f in tests.glob("test_*.py") if f"{f.name} |" not in listed)
    assert not missing, f"tests/README.md does not describe: {missing}"
