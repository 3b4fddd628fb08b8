"""The house rules a reader relies on (issue 24): no module of hf_ppmoe over 600 lines, and no method assigned onto a
class from another module (a class's behaviour is in the class)."""

import ast
from pathlib import Path

import hf_ppmoe

PACKAGE = Path(hf_ppmoe.__file__).parent


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
