"""The package's layering, read from the import statements: commands stay thin, the scheduler is one package."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "treegraft_cli"


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (``treegraft_cli.x.y`` for relative imports)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # ``from . import console``
    return found


def modules_importing(prefix: str, paths) -> list[str]:
    return sorted(
        str(path.relative_to(PACKAGE.parent))
        for path in paths
        if any(name == prefix or name.startswith(prefix + ".") for name in imported_modules(path))
    )


def test_only_the_commands_import_typer_and_rich():
    core = [path for path in PACKAGE.rglob("*.py") if "cli" not in path.relative_to(PACKAGE).parts[:-1]
            and path.name != "__main__.py"]
    for library in ("typer", "rich"):
        assert modules_importing(library, core) == [], f"{library} is the commands' (treegraft_cli/cli) alone"


def test_the_scheduler_never_imports_the_tree_builder():
    """``grafting`` (the layer loop) asks ``scheduling`` (policies, settings) what to do; never the other way round."""
    assert modules_importing("treegraft_cli.grafting", (PACKAGE / "scheduling").rglob("*.py")) == []
    assert modules_importing("treegraft_cli.scheduling", (PACKAGE / "grafting").rglob("*.py")) != []  # the direction that is meant


def test_relative_imports_resolve_as_python_does():
    imports = imported_modules(PACKAGE / "scheduling" / "replay.py")
    assert "treegraft_cli.scheduling.costs" in imports and "treegraft_cli.errors" in imports


def test_one_module_prints():
    printing = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "print":
                printing.append(str(path.relative_to(PACKAGE)))
    assert set(printing) == {"cli/console.py"}
