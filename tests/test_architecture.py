"""The layers of docs/architecture.md hold: imports run one way, through the packages'
public faces, without cycles; and no function grows past its complexity or length bound
without docs/architecture.md saying why."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_THE_PACKAGE = ("tests", "bench", "examples", "build", "native", "scripts", "deploy", "docs")

# What each layer may import at run time (imports under TYPE_CHECKING are types only).
ALLOWED = {
    "protocols": set(),
    "backends": {"protocols"},
    "caches": {"protocols"},
    "telemetry": {"protocols"},
    "repository": {"backends", "protocols"},
    "actors": {"backends", "caches", "protocols", "repository", "telemetry"},
    "_options": {"actors", "protocols", "repository"},
    "_server": {"_options", "actors", "backends", "caches", "protocols", "repository", "telemetry"},
    "_blocking": {"_options", "_server", "actors", "protocols"},
    "_aio": {"_options", "_server", "actors", "backends", "protocols"},
    "aio": {"_aio"},
    "frontends": {
        "_server",
        "_blocking",
        "actors",
        "backends",
        "protocols",
        "repository",
        "telemetry",
        "tuning",
        "__init__",
    },
    "tuning": {"_server", "protocols", "repository"},
    "__main__": {"frontends"},
}
PACKAGE_FOLDERS = (
    "actors",
    "backends",
    "caches",
    "frontends",
    "protocols",
    "repository",
    "telemetry",
    "tuning",
)
MAX_COMPLEXITY = 12
"""McCabe's bound per function (``[tool.ruff.lint.mccabe]`` in pyproject.toml says the same)."""
MAX_FUNCTION_LINES = 80


def _package_modules() -> list[Path]:
    modules = [
        ROOT / name
        for name in (
            "_options.py",
            "_server.py",
            "_blocking.py",
            "_aio.py",
            "aio.py",
            "__main__.py",
        )
    ]
    for folder in PACKAGE_FOLDERS:
        modules.extend(sorted((ROOT / folder).glob("*.py")))
    return modules


def _layer(path: Path) -> str:
    relative = path.relative_to(ROOT)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _type_only(tree: ast.Module) -> set[int]:
    """The nodes under ``if TYPE_CHECKING:`` (imports for type checkers only), by id."""
    return {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }


def _runtime_imports(path: Path) -> set[str]:
    """The layers ``path`` imports from at run time (relative imports of the package)."""
    tree = ast.parse(path.read_text())
    type_only = _type_only(tree)
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or not node.level or id(node) in type_only:
            continue
        base = path.parent
        for _ in range(node.level - 1):
            base = base.parent
        target = base / node.module.split(".")[0] if node.module else base
        relative = target.relative_to(ROOT)
        found.add(relative.parts[0] if relative.parts else "__init__")
    return found


def test_imports_run_one_way() -> None:
    wrong = []
    for path in _package_modules():
        layer = _layer(path)
        for imported in _runtime_imports(path) - {layer}:
            name = imported.removesuffix(".py")
            if name not in ALLOWED[layer]:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert wrong == []
    assert len(_package_modules()) > 50  # the walk found the package


def test_packages_use_each_others_public_faces() -> None:
    """A module takes another package's names from that package, never from one of its
    private modules, at run time or for type checkers; ``orchestrion.testing`` too."""
    reached = []
    for path in [*_package_modules(), *sorted((ROOT / "testing").glob("*.py"))]:
        own = _layer(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                parts = (node.module or "").split(".")
            elif (node.module or "").startswith("orchestrion."):
                parts = (node.module or "").split(".")[1:]
            else:
                continue
            if len(parts) == 2 and parts[0] != own and parts[1].startswith("_"):
                reached.append(f"{path.relative_to(ROOT)} imports {node.module}")
    assert reached == []


def test_the_runtime_imports_no_jax() -> None:
    """JAX is the backends' business: device rows, tracing and devices go through them."""
    reaching = []
    for path in sorted((ROOT / "actors").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(name == "jax" or name.startswith("jax.") for name in names):
                reaching.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert reaching == []


def test_the_runners_parts_receive_the_executor() -> None:
    """The batcher, the sequence batcher, the streams and an ensemble's fused call are given
    an `Executor`; none of them imports the runner (nor reaches into its pool, backend or
    statistics through one)."""
    parts = ("_batcher", "_sequence_batcher", "_sequences", "_streams", "_fusion", "_listed_fusion")
    reaching = []
    for name in parts:
        path = ROOT / "actors" / f"{name}.py"
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module in ("_runner", "actors._runner"):
                reaching.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports the runner")
            if isinstance(node, ast.Attribute) and node.attr in ("pool", "backend", "stats"):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id == "runner":
                    reaching.append(f"{path.relative_to(ROOT)}:{node.lineno}: runner.{node.attr}")
    assert reaching == []


def test_nothing_switches_on_which_runner_it_has() -> None:
    """The registry, the router and the front ends ask a `Runner` what differs between a
    model and an ensemble; one place takes a model's runner apart: an ensemble's fused call
    needs its steps' executors (``fusable``)."""
    runners = {"ModelRunner", "EnsembleRunner"}
    switching = []
    for path in _every_module():
        if path.parts[-2] == "testing":
            continue  # `Inside` hands tests the kind they ask for
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                if named & runners:
                    switching.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert [s.split(":")[0] for s in switching] == ["actors/_ensemble_fusion.py"], switching


def test_tests_look_inside_a_server_through_one_object() -> None:
    """Tests, benchmarks and ``orchestrion.testing`` reach a running server's runtime
    through `orchestrion.testing.inside` alone, not through the server's private
    attributes (its registry, an ensemble's fusion or steps)."""
    private = {"_registry", "_fusion", "_steps", "_runners"}
    places = [*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").glob("*.py")]
    places += (ROOT / "testing").glob("*.py")
    reaching = []
    for path in sorted(places):
        if path == ROOT / "testing" / "_inside.py" or path == Path(__file__).resolve():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private:
                owner = node.value
                if not (isinstance(owner, ast.Name) and owner.id == "self"):
                    reaching.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert reaching == []


def test_the_architecture_page_names_what_exists() -> None:
    """Every file docs/architecture.md names exists (a Rust file: in ``native/src``), and
    every ``Class.method`` it names is defined: a move or a rename that forgets the page
    fails here."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for path in sorted(set(re.findall(r"`([A-Za-z0-9_./-]+\.(?:py|rs))`", text))):
        rust = path.endswith(".rs") and "/" not in path
        where = ROOT / "native" / "src" / path if rust else ROOT / path
        if path != "model.py" and not where.exists():
            missing.append(path)
    methods: dict[str, set[str]] = {}
    for module in _every_module():
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ClassDef):
                own = methods.setdefault(node.name, set())
                own.update(
                    n.name
                    for n in node.body
                    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                )
    for owner, name in sorted(set(re.findall(r"`([A-Z][A-Za-z]+)\.([a-z_]+)`", text))):
        if name not in methods.get(owner, set()):
            missing.append(f"{owner}.{name}")
    assert missing == []


def _every_module(root: Path = ROOT) -> list[Path]:
    """Every module of the package, ``testing/`` and the top level included."""
    return sorted(
        path
        for path in root.rglob("*.py")
        if path.relative_to(root).parts[0] not in NOT_THE_PACKAGE
        and not any(p.startswith(".") or p == "__pycache__" for p in path.relative_to(root).parts)
    )


def _module_name(path: Path, root: Path) -> str:
    name = path.relative_to(root).with_suffix("").as_posix()
    return "" if name == "__init__" else name.removesuffix("/__init__")


def _imported_modules(path: Path, root: Path, modules: set[str]) -> Iterator[str]:
    """The package's modules ``path`` imports: at run time, for type checkers only, or inside
    a function; relative or as ``orchestrion.``."""
    name = Path(_module_name(path, root))
    package = name if path.name == "__init__.py" else name.parent
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.parent
                target = (base / (node.module or "").replace(".", "/")).as_posix()
            elif node.module == "orchestrion" or (node.module or "").startswith("orchestrion."):
                target = (node.module or "").removeprefix("orchestrion").replace(".", "/")
            else:
                continue
            target = target.strip("/").removeprefix("./") if target != "." else ""
            for alias in node.names:  # a name may be a submodule (``from . import x``)
                submodule = f"{target}/{alias.name}".strip("/")
                yield submodule if submodule in modules else target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("orchestrion."):
                    yield alias.name.removeprefix("orchestrion.").replace(".", "/")


def _import_cycles(root: Path = ROOT) -> list[list[str]]:
    """The strongly connected groups of the import graph (Tarjan's, without recursion)."""
    paths = {_module_name(p, root): p for p in _every_module(root)}
    names = set(paths)
    graph = {
        name: sorted({t for t in _imported_modules(path, root, names) if t in names and t != name})
        for name, path in paths.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, edge = work.pop()
            if edge == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
            if edge < len(graph[node]):
                work.append((node, edge + 1))
                child = graph[node][edge]
                if child not in index:
                    work.append((child, 0))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    cycles.append(sorted(group))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return cycles


def test_no_module_imports_itself_around_a_cycle() -> None:
    """No import cycles among the package's modules, ``testing/`` included, counting imports
    for type checkers and those inside functions too."""
    assert len(_every_module()) > 100  # the walk found the package
    assert _import_cycles() == []


def test_the_cycle_check_sees_a_cycle(tmp_path: Path) -> None:
    """The check itself: a type-only import back is a cycle, one through a function's import
    and through a package's face too; a plain import is not."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("from .b import B\n")
    (tmp_path / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"
    )
    (tmp_path / "c.py").write_text("from . import a\n")
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "__init__.py").write_text("from ._x import X\n")
    (tmp_path / "p" / "_x.py").write_text("def f():\n    from orchestrion.q import Y\n")
    (tmp_path / "q.py").write_text("from .p import X\n")
    assert _import_cycles(tmp_path) == [["a", "b"], ["p", "p/_x", "q"]]


def test_functions_stay_simple_and_short() -> None:
    """Every function of the package under McCabe's bound (ruff's C901, as CI's ``ruff check``
    runs it) and 80 lines; the few exempt (``noqa: C901``) each named, with why, in
    docs/architecture.md."""
    ruff = Path(sys.executable).parent / "ruff"
    found = subprocess.run(
        [str(ruff), "check", "--select", "C901", "--output-format", "concise", "--quiet", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    complex_ = [line for line in found.stdout.splitlines() if "C901" in line]
    assert complex_ == []
    too_long = []
    exempt = []
    for path in _every_module():
        text = path.read_text()
        relative = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{relative}:{node.lineno} {node.name}: {length} lines")
        exempt += re.findall(r"def (\w+)\(.*#\s*noqa: C901", text)
    assert too_long == []
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    assert [name for name in exempt if f"`{name}`" not in architecture] == []
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f"max-complexity = {MAX_COMPLEXITY}" in pyproject
