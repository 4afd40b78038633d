"""Loads a script of ``benchmarks/`` as a module, for the tests of its argument handling and helpers."""

import importlib.util
import os
from types import ModuleType

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported under ``name`` (its ``__main__`` block not run)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
