"""The server freezes its start-up heap once the engine is built; objects made later are collected as before."""

from __future__ import annotations

import subprocess
import sys

FREEZE_THEN_COLLECT = """
import gc, weakref
import torch, transformers  # a start-up heap of the size a server has
from hybridserve.entrypoints.gc_heap import freeze_startup_heap

frozen = freeze_startup_heap()
assert frozen == gc.get_freeze_count() > 50_000, frozen
assert len(gc.get_objects()) < frozen // 100  # collections traverse only what came after

class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a  # a reference cycle made after the freeze
ref = weakref.ref(a)
del a, b
gc.collect()
assert ref() is None
print("ok")
"""


def test_freezing_the_start_up_heap_keeps_later_cycles_collectable():
    run = subprocess.run([sys.executable, "-c", FREEZE_THEN_COLLECT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_serve_freezes_the_heap_after_building_the_engine_and_before_serving(monkeypatch, tmp_path):
    import hybridserve.engine.llm_engine as llm_engine
    import hybridserve.entrypoints.gc_heap as gc_heap
    import hybridserve.entrypoints.openai.api_server as api_server
    from hybridserve.entrypoints.cli import main

    calls = []
    monkeypatch.setattr(llm_engine, "LLMEngine", lambda config: calls.append("engine") or object())
    monkeypatch.setattr(gc_heap, "freeze_startup_heap", lambda: calls.append("freeze"))
    monkeypatch.setattr(api_server, "run_server", lambda engine, **kwargs: calls.append("serve") or 0)
    assert main(["serve", str(tmp_path)]) == 0
    assert calls == ["engine", "freeze", "serve"]
