"""The engine's split by job (docs/engine.md): who may import and reach into what."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import hybridserve

PACKAGE = Path(hybridserve.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_distributed_does_not_import_the_engine():
    """The tensor-parallel ranks build through engine/worker.py, as rank 0 does: no circle through llm_engine."""
    offenders = {path.name: sorted(m for m in _imported_modules(path) if m.startswith("hybridserve.engine.llm_engine"))
                 for path in sorted((PACKAGE / "distributed").glob("*.py"))}
    assert {name: mods for name, mods in offenders.items() if mods} == {}


def test_rank_workers_build_with_the_engine_worker():
    assert "hybridserve.engine.worker.Worker" in _imported_modules(PACKAGE / "distributed" / "worker.py")


@pytest.mark.parametrize("name", ["llm_engine.py", "async_engine.py", "output_processor.py", "worker.py"])
def test_engine_modules_stay_small(name):
    num_lines = len((PACKAGE / "engine" / name).read_text().splitlines())
    assert num_lines <= 400, f"engine/{name} has {num_lines} lines"


def _reaches(path: Path, owner: str, attributes: set[str]) -> list[str]:
    """``owner.attribute`` accesses in ``path`` (``owner`` itself an attribute, as in ``self.cache.prefix``)."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and node.attr in attributes and isinstance(node.value, ast.Attribute)
                and node.value.attr == owner):
            hits.append(f"line {node.lineno}: {owner}.{node.attr}")
    return hits


@pytest.mark.parametrize("name", ["llm_engine.py", "output_processor.py", "async_engine.py"])
def test_the_engine_asks_the_scheduler_and_the_cache_instead_of_reaching_in(name):
    path = PACKAGE / "engine" / name
    assert _reaches(path, "scheduler", {"running", "waiting", "suspects"}) == []
    assert _reaches(path, "cache", {"prefix"}) == []
