"""The house rules a reader relies on (issues 24 and 30): no module of hf_ppmoe over 600 lines, no method assigned
onto a class from another module (a class's behaviour is in the class), no import cycle between the modules of any
top-level package of the repository, and no two modules of one file name unless they are the same kind of thing."""

import ast
import collections
from pathlib import Path

import pytest

import hf_ppmoe

PACKAGE = Path(hf_ppmoe.__file__).parent
ROOT = PACKAGE.parent
TOP_LEVEL = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name.startswith("hf_ppmoe"))


def test_no_module_over_600_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_no_method_is_assigned_onto_an_imported_class():
    """`SomeClass.method = function` at module level, where SomeClass is imported, is how parallelism used to patch the
    model classes; it is gone and stays gone."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom) for alias in node.names}
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id in imported:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {target.value.id}.{target.attr} = ...")
    assert not found, found


def _imports(path: Path, package: str, modules) -> set[str]:
    """The repository modules `path` imports, relative or absolute, at any depth of the file (a function's lazy import
    counts: it runs the same module graph, later)."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            imported.add(target)
            imported.update(f"{target}.{alias.name}" for alias in node.names)  # `from . import expert_parallel`
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    return {m for m in imported if m in modules}


def _module_graph() -> dict[str, set[str]]:
    modules = {}
    for top in TOP_LEVEL:
        for path in (ROOT / top).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            package = name.rsplit(".", 1)[0] if path.name != "__init__.py" else name.removesuffix(".__init__")
            modules[name.removesuffix(".__init__")] = (path, package)
    # a subpackage's __init__ only hands names on (its modules are nodes of their own); a top-level package's
    # __init__ can be a module in its own right (hf_ppmoe_cli is one)
    nodes = {name for name, (path, _) in modules.items() if path.name != "__init__.py" or "." not in name}
    return {name: _imports(path, package, nodes) - {name} for name, (path, package) in modules.items() if name in nodes}


def _cycles(graph) -> list[list[str]]:
    state, found = {}, []

    def visit(name, trail):
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                found.append([*trail, name, target])
            elif target not in state:
                visit(target, [*trail, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    return found


def test_the_cycle_check_covers_every_top_level_package():
    assert {"hf_ppmoe", "hf_ppmoe_cli"} <= set(TOP_LEVEL)
    graph = _module_graph()
    assert "hf_ppmoe_cli" in graph and "hf_ppmoe.modeling.common" in graph
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]


def test_no_import_cycle():
    """No import cycle in hf_ppmoe or across the top-level packages (absolute, relative and in-function imports)."""
    assert _cycles(_module_graph()) == []


# modules of one file name in two packages that are the same kind of thing (a package's face, an entry point)
SAME_KIND = {"__init__.py", "__main__.py"}


def test_no_two_modules_of_one_name():
    names = collections.defaultdict(list)
    for top in TOP_LEVEL:
        for path in (ROOT / top).rglob("*.py"):
            names[path.name].append(str(path.relative_to(ROOT)))
    twice = {name: sorted(paths) for name, paths in names.items() if len(paths) > 1 and name not in SAME_KIND}
    assert twice == {}, "two modules of one name in different packages: " + repr(twice)


# files a comment may not point at: they are not in the repository
OUTSIDE = ("DESIGN.md", "STYLE.md", "STYLE lesson", "megatron.py")


def test_no_comment_points_outside_the_repository():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for top in TOP_LEVEL
        for path in (ROOT / top).rglob("*.py")
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if any(name in line for name in OUTSIDE)
    ]
    assert not found, "\n".join(found)


# The package direction of docs/architecture.md: a package imports only packages to its right (or in its own group,
# without a circle between packages). `cli` and the package's face (`__init__`) sit above everything; the demo and the
# server are applications of the rest.
DIRECTION = [{"__init__", "cli"}, {"demo", "serving"}, {"training"}, {"conversion", "megatron", "parallel", "peft", "planning"},
             {"modeling"},
             {"generation", "moe"}, {"utils"}]


def _package_edges() -> dict[tuple[str, str], str]:
    """(importing package, imported package) -> one example import, over hf_ppmoe's modules (relative, absolute and
    in-function imports; `from .. import parallel` counts as importing hf_ppmoe.parallel)."""
    def package(module: str) -> str:  # hf_ppmoe.training.train -> training; hf_ppmoe.__init__ -> __init__
        return module.split(".")[1]

    edges = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts)
        own = name.rsplit(".", 1)[0] if path.name != "__init__.py" else name.removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = own.rsplit(".", node.level - 1)[0] if node.level > 1 else own
                base = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
                targets = [f"{base}.{alias.name}" for alias in node.names] if not node.module else [base]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                if target.split(".")[0] != "hf_ppmoe" or target == "hf_ppmoe":
                    continue
                src, dst = package(name), package(target)
                if src != dst:
                    edges.setdefault((src, dst), f"{rel}: {target}")
    return edges


def test_packages_import_one_way():
    tier = {name: i for i, group in enumerate(DIRECTION) for name in group}
    packages = {p.parent.name if p.name == "__init__.py" else p.stem for p in PACKAGE.glob("*/__init__.py")}
    packages |= {p.stem for p in PACKAGE.glob("*.py")}
    assert packages <= set(tier), f"place these in DIRECTION: {packages - set(tier)}"
    edges = _package_edges()
    assert ("training", "parallel") in edges and ("modeling", "moe") in edges  # the scan sees imports
    upward = [f"{a} -> {b} ({example})" for (a, b), example in edges.items() if tier[a] > tier[b]]
    assert not upward, "imports against the package direction:\n" + "\n".join(upward)
    circles = _cycles({p: {b for (a, b) in edges if a == p} for p in tier})
    assert circles == [], f"packages importing each other: {circles}"
