"""The layer contract (``[tool.importlinter]`` in pyproject.toml, README "Architecture") holds
on this tree, and bites: a copy of the tree with one deliberate upward import breaks it.

import-linter runs as CI runs it (``lint-imports``), in a subprocess whose working directory
is the tree to check, so the copy's packages are the ones analysed, never the ones this test
process has imported. The copy takes every file of the contract's root packages as they are
now, so the checks follow the code wherever it moves.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from django.conf import settings

ROOT = Path(settings.BASE_DIR)
CONFIG = ROOT / "pyproject.toml"
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def _root_packages() -> list[str]:
    return tomllib.loads(CONFIG.read_text())["tool"]["importlinter"]["root_packages"]


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on ``tree`` (its pyproject.toml), without a cache; exit 0 = every contract kept."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(COLUMNS="400", NO_COLOR="1", TERM="dumb")  # one violation per line, no escapes
    return subprocess.run(
        [sys.executable, "-c", LINT_IMPORTS, "--no-cache", "--no-logo"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def tree_copy(tmp_path) -> Path:
    """A copy of the contract's root packages and pyproject.toml, to add an import to."""
    for package in _root_packages():
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(CONFIG, tmp_path / "pyproject.toml")
    return tmp_path


def add_import(tree: Path, module: str, statement: str) -> None:
    """Append ``statement`` to ``module`` in ``tree``, a module file or a package's __init__."""
    path = tree.joinpath(*module.split("."))
    target = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    assert target.is_file(), f"{module} is not in the tree: the test names a module that moved"
    target.write_text(target.read_text() + f"\n{statement}  # noqa: E402, F401 (the upward import under test)\n")


def test_every_contract_is_kept_on_this_tree():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout


def test_the_copy_of_the_tree_is_checked_as_the_tree_itself(tree_copy):
    # The baseline for the tests below: the copy alone gives the same verdict as the tree, so
    # what they see broken is the one import they add.
    assert lint_imports(tree_copy).returncode == lint_imports(ROOT).returncode


def test_the_kernel_importing_an_app_breaks_the_layers_contract(tree_copy):
    (tree_copy / "zeromem" / "kernel" / "upward.py").write_text(
        '"""A deliberate upward import: the kernel must not know the apps."""\n\nfrom memories.models import Memory\n'
    )
    result = lint_imports(tree_copy)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "zeromem.kernel is not allowed to import memories.models" in result.stdout, result.stdout
    assert "zeromem.kernel.upward -> memories.models" in result.stdout, result.stdout


def test_a_service_importing_a_surface_breaks_the_layers_contract(tree_copy):
    add_import(tree_copy, "memories.selectors", "import memories.api")
    result = lint_imports(tree_copy)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "memories.selectors is not allowed to import memories.api" in result.stdout, result.stdout


def test_a_surface_importing_another_surface_breaks_the_layers_contract(tree_copy):
    add_import(tree_copy, "memories.tasks", "import memories.api")
    result = lint_imports(tree_copy)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "memories.tasks is not allowed to import memories.api" in result.stdout, result.stdout


def test_audit_importing_memories_breaks_the_forbidden_contract(tree_copy):
    # services → models is downward, so only the audit rule catches this one.
    add_import(tree_copy, "audit.services", "import memories.models")
    result = lint_imports(tree_copy)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "audit.services -> memories.models" in result.stdout, result.stdout


def test_test_modules_import_helpers_from_factories_never_from_conftest():
    # conftest.py holds fixtures; the data builders are in tests/factories.py.
    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "conftest":
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []
