"""The package's shape, read from its source with `ast` (no module is imported here):

- no import cycle between modules of oobleck_hpc;
- no module of oobleck_hpc imports from `tests`, and no file of oobleck_hpc/ mentions OOBLECK_TEST;
- production code never imports `oobleck_hpc.testing` (test and benchmark support only);
- no module of oobleck_hpc is longer than 400 lines after its docstring, unless its docstring is a
  written protocol (PROTOCOL_MODULES);
- no function of oobleck_hpc/control/ or oobleck_hpc/recovery/ is longer than 60 lines;
- the directions of import between packages (DESIGN.md): the control plane never imports torch,
  the engine never imports recovery, each heavy dependency lives in its one module.

The dependency graph: every module `oobleck_hpc/a/b.py` is the node `oobleck_hpc.a.b`, and a
package's `__init__.py` is the node of the package (`oobleck_hpc/a/__init__.py` -> `oobleck_hpc.a`).
Every import statement counts, at the top of a module or inside a function or a method (a lazy
import runs too, only later), relative imports resolved against the module's package:

- `import a.b.c` depends on `a.b.c` (the longest prefix that is a module of the package);
- `from a.b import c` depends on `a.b.c` when that is a module, else on `a.b`;
- importing `a.b.c` also runs the `__init__.py` of the packages `a` and `a.b`: the module depends
  on those packages too, except on its own enclosing packages (already being imported when the
  module runs, so not a new dependency; a package's `__init__` that imports one of its own
  modules is the ordinary shape of a package).

Not counted: imports under `if TYPE_CHECKING:`, which never run (they name types for
annotations only); a module that needs the name at run time must import it for real, and then
it counts.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "oobleck_hpc"
MAX_LINES = 400
PROTOCOL_MODULES = {"oobleck_hpc/control/membership.py"}
"""Modules whose docstring is a written protocol (the membership protocol and its safety
argument): the specification stays next to the code it specifies, and the module is not held to
MAX_LINES."""
MAX_FUNCTION_LINES = 60


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.lru_cache(maxsize=None)
def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _import_nodes(tree: ast.AST, lazy: bool = True):
    """Every Import / ImportFrom node, at any depth, outside `if TYPE_CHECKING:` bodies; with
    lazy=False, only those that run when the module is imported (not inside a function)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if not lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        stack.extend(ast.iter_child_nodes(node))


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    """The parsed module (once per session: the checks below read every module several times)."""
    return ast.parse(path.read_text(), str(path))


@functools.lru_cache(maxsize=None)
def _imported_names(module: str, path: Path, modules: frozenset[str] = frozenset(),
                    lazy: bool = True) -> tuple[tuple[str, int], ...]:
    """(absolute dotted name, line) of everything `module` imports: `a.b` for `import a.b`;
    for `from a.b import c`, `a.b.c` when that is one of `modules`, else `a.b`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in _import_nodes(_tree(path), lazy):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            out.append((sub if sub in modules else base, node.lineno))
    return tuple(out)


def _enclosing(name: str) -> list[str]:
    """`a.b.c` -> [`a`, `a.b`]."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def dependency_graph(package: Path = PACKAGE, lazy: bool = True) -> dict[str, dict[str, int]]:
    """module -> {module it depends on -> line of the first import that makes it so}; with
    lazy=False, only the imports that run when the module is imported."""
    modules = _modules(package)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        own = set(_enclosing(module)) | ({module} if path.name == "__init__.py" else set())
        deps: dict[str, int] = {}
        for name, line in _imported_names(module, path, frozenset(modules), lazy):
            target = name
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if not target:
                continue  # not a module of the package
            deps.setdefault(target, line)
            for package in _enclosing(target):  # the packages whose __init__ runs first
                if package in modules and package not in own:
                    deps.setdefault(package, line)
        deps.pop(module, None)
        graph[module] = deps
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle [m0, m1, ..., m0] of the graph, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path = [root]
        iters = [iter(sorted(graph[root]))]
        state[root] = 1
        while iters:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph.get(nxt, ()))))
    return None


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return "\n".join(f"  {a} -> {b}  (import at line {graph[a][b]} of {a})"
                     for a, b in zip(cycle, cycle[1:]))


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """The parser itself, on a small package: top-level, lazy, relative and submodule imports,
    the enclosing packages' __init__, and TYPE_CHECKING imports left out."""
    files = {
        "__init__.py": "from pkg.a import f\n",
        "a.py": "from pkg import d\n\ndef f():\n    from . import b  # lazy, relative\n",
        "b.py": "from .sub.c import g\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import x\n",
        "sub/__init__.py": "",
        "sub/c.py": "import pkg.a\n\ndef g():\n    return pkg.a\n",
    }
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    graph = dependency_graph(tmp_path / "pkg")
    assert graph == {
        "pkg": {"pkg.a": 1},
        "pkg.a": {"pkg.d": 1, "pkg.b": 4},
        "pkg.b": {"pkg.sub.c": 1, "pkg.sub": 1},
        "pkg.d": {},
        "pkg.sub": {},
        "pkg.sub.c": {"pkg.a": 1},
    }
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]  # through a lazy import
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"b": 1}}) is None
    # On the package itself: a lazy import (ModelConfig.check) and the package it runs first.
    real = dependency_graph()
    assert {"oobleck_hpc.models.configs", "oobleck_hpc.models"} <= set(
        real["oobleck_hpc.configs.training"])


def test_no_import_cycles():
    graph = dependency_graph()
    cycle = find_cycle(graph)
    assert cycle is None, ("import cycle between modules of oobleck_hpc:\n" + _describe(cycle, graph)
                           + "\nFix: move what both need into a third module")


def test_the_package_does_not_depend_on_the_tests():
    offenders = []
    for module, path in _modules().items():
        for name, line in _imported_names(module, path):
            if name == "tests" or name.startswith("tests."):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    for path in sorted(PACKAGE.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".sh", ".txt", ".md", ".yaml", ".json"):
            for i, text in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if re.search("OOBLECK_TEST", text):
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{i} mentions OOBLECK_TEST")
    assert not offenders, "\n".join(offenders)


def test_production_code_never_imports_the_testing_support():
    offenders = []
    for module, path in _modules().items():
        if module == "oobleck_hpc.testing" or module.startswith("oobleck_hpc.testing."):
            continue
        for name, line in _imported_names(module, path):
            if name == "oobleck_hpc.testing" or name.startswith("oobleck_hpc.testing."):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_no_function_of_the_elastic_layer_is_longer_than_60_lines():
    long = []
    for path in sorted([*(PACKAGE / "control").glob("*.py"), *(PACKAGE / "recovery").glob("*.py")]):
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.name}:{node.lineno} {node.name}() {n} lines")
    assert not long, "\n".join(long) + "\nFix: split it into named steps"


def test_no_module_is_longer_than_400_lines():
    """Lines after the module docstring; a module whose docstring is a written protocol
    (PROTOCOL_MODULES) is exempt."""
    too_long = {}
    for path in _modules().values():
        name = path.relative_to(PACKAGE.parent).as_posix()
        text = path.read_text()
        tree = _tree(path)
        doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) and \
            isinstance(getattr(tree.body[0], "value", None), ast.Constant) and \
            isinstance(tree.body[0].value.value, str) else None
        lines = len(text.splitlines()) - (doc.end_lineno if doc is not None else 0)
        if lines > MAX_LINES and name not in PROTOCOL_MODULES:
            too_long[name] = lines
    assert not too_long, (f"modules over {MAX_LINES} lines: {too_long}; split them by concern "
                          f"(one module per concern, re-exported where callers import them)")


OPTIONAL_OWNERS = {"transformers": "oobleck_hpc.models.hf",
                   "safetensors": "oobleck_hpc.models.hf_weights"}
"""The optional extra's packages (`pip install 'oobleck_hpc[hf]'`) and the one module that
imports each (DESIGN.md, "Directions of import"): nothing else needs them. (tokenizers:
data/hf.py, checked by running it, tests/test_datasets.py.)"""


def test_an_optional_package_is_imported_by_its_one_module_only():
    for package, owner in OPTIONAL_OWNERS.items():
        offenders = []
        for module, path in _modules().items():
            for name, line in _imported_names(module, path):
                if name.split(".")[0] == package and module != owner:
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
        where = owner.removeprefix("oobleck_hpc.").replace(".", "/") + ".py"
        assert not offenders, "\n".join(offenders) + f"\nFix: reach {package} through {where}"


STARTS_A_PROCESS = ("subprocess", "multiprocessing", "os.fork", "WorkerPool", "as_nobody",
                    "LocalRun", "oobleck_hpc.testing.harness")
"""What starts another process in this suite: the names a test of tests/unit/ may not use."""


def test_the_unit_tier_starts_no_process():
    """tests/unit/ is the quick tier (scripts/test.sh --quick): a test that starts a process
    belongs in tests/."""
    offenders = [f"{path.name}:{number}: {line.strip()}"
                 for path in sorted(Path(__file__).parent.glob("*.py"))
                 if path.name != Path(__file__).name
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if any(name in line for name in STARTS_A_PROCESS)]
    assert not offenders, "\n".join(offenders) + "\nFix: move these tests to tests/"


def _reach(graph: dict[str, dict[str, int]], start: str) -> dict[str, list[str]]:
    """Every module `start` imports, directly or through others (lazy imports too), with one
    chain of imports that gets there."""
    chains = {start: [start]}
    todo = [start]
    while todo:
        module = todo.pop()
        for dep in graph.get(module, ()):
            if dep not in chains:
                chains[dep] = chains[module] + [dep]
                todo.append(dep)
    return chains


@functools.lru_cache(maxsize=None)
def _external(module: str, lazy: bool = True) -> frozenset[str]:
    """The top-level names of what `module` imports from outside the package (torch, h5py...),
    with `torch.distributed` kept whole."""
    path = _modules()[module]
    out = set()
    for name, _ in _imported_names(module, path, lazy=lazy):
        if not name.startswith("oobleck_hpc"):
            out.add("torch.distributed" if name.startswith("torch.distributed") else name.split(".")[0])
    return frozenset(out)


NEVER = {
    "oobleck_hpc.control": {"torch", "oobleck_hpc.recovery", "oobleck_hpc.engine"},
    "oobleck_hpc.records": {"torch", "oobleck_hpc.recovery", "oobleck_hpc.engine"},
    "oobleck_hpc.planning": {"torch.distributed", "h5py", "mpi4py", "submitit"},
    "oobleck_hpc.engine": {"oobleck_hpc.recovery", "oobleck_hpc.control"},
    "oobleck_hpc.fleet": {"torch", "h5py", "mpi4py", "submitit", "oobleck_hpc.recovery",
                          "oobleck_hpc.engine", "oobleck_hpc.control", "oobleck_hpc.launch"},
}
"""Package -> what none of its modules may import, lazily or not, nor load when imported through
any chain of imports (DESIGN.md, "Directions of import"): agents start without torch; the engine
reports failures as values; the fleet's decision is arithmetic on the planner's curves. (A lazy
import elsewhere runs only where it is called: a function of config that imports the models is
one the agents never call, and the tests that start agents check that torch stays out of them.)"""

OWNERS = {"h5py": "oobleck_hpc.profiling.store", "mpi4py": "oobleck_hpc.bootstrap.discovery",
          "submitit": "oobleck_hpc.launch.slurm"}
"""Each heavy dependency and the one module that imports it."""


def test_the_directions_of_import_between_packages_hold():
    graph, loaded = dependency_graph(), dependency_graph(lazy=False)

    def forbidden(module: str, never: set[str], lazy: bool) -> set[str]:
        bad = {n for n in never if module == n or module.startswith(n + ".")}
        return bad | (_external(module, lazy) & never)

    offenders = []
    for package, never in NEVER.items():
        for module in sorted(m for m in graph if m == package or m.startswith(package + ".")):
            direct = set(graph[module]) | {module}
            for dep in sorted(direct):
                if bad := forbidden(dep, never, lazy=dep == module):
                    offenders.append(f"{module} imports {sorted(bad)} (via {dep})")
            for reached, chain in sorted(_reach(loaded, module).items()):
                if bad := forbidden(reached, never, lazy=False):
                    offenders.append(f"importing {module} loads {sorted(bad)}: "
                                     + " -> ".join(chain))
    for dependency, owner in OWNERS.items():
        offenders += [f"{module} imports {dependency} (only {owner} may)"
                      for module in graph if module != owner and dependency in _external(module)]
    assert not offenders, "\n".join(offenders) + "\nFix: move the code to the side it belongs to"


def test_the_direction_check_sees_a_chain_of_imports():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {}}
    assert _reach(graph, "a") == {"a": ["a"], "b": ["a", "b"], "c": ["a", "b", "c"]}
