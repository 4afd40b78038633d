"""Kernel graphs (``kernels/graph.py``): capture of a function's kernel calls, the arena plan, and
replay against the eager calls; the registries (``csrc/registry.h``) against ``csrc/kernels.h``."""

from __future__ import annotations

import re

import pytest
import torch

from hybridserve.kernels import _abi, build, graph, pointwise
from tests.kernels.helpers import needs_compiler

pytestmark = needs_compiler


def _norm_chain(x: torch.Tensor, w: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` RMS norms in a row, each output a fresh temporary."""
    for _ in range(steps):
        x = pointwise.rms_norm(x, w, 1e-6)
    return x


@pytest.fixture
def lib():
    if pointwise._library() is None or _abi.bind("graph") is None:
        pytest.skip("no compiled kernels")
    return pointwise._library()


def test_replay_equals_eager_and_temporaries_share_the_arena(lib):
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.rand(64, dtype=torch.bfloat16) + 0.5
    expected = _norm_chain(x, w, 6)
    g = graph.capture(lambda: _norm_chain(x, w, 6), [graph.tensor_region(x), graph.tensor_region(w)])
    assert g.num_calls == 6 and g.kernel_names == ["hs_rms_norm"] * 6
    # six (4, 64) bf16 temporaries of 512 bytes, at most two alive at a time
    assert g.arena_bytes == 2 * 512
    g.place(torch.empty(g.arena_bytes, dtype=torch.uint8))
    assert torch.equal(g.replay(), expected)
    x.copy_(torch.randn(4, 64, dtype=torch.bfloat16))  # a static input changes between replays
    assert torch.equal(g.replay(), _norm_chain(x, w, 6))


def test_a_pytorch_operator_refuses_the_capture_by_name(lib):
    x = torch.randn(2, 8)
    w = torch.ones(8)
    with pytest.raises(graph.CaptureError, match=r"aten.add x1"):
        graph.capture(lambda: pointwise.rms_norm(x + 1, w, 1e-6), [graph.tensor_region(x), graph.tensor_region(w)])


def test_memory_outside_the_known_regions_refuses_the_capture(lib):
    x = torch.randn(2, 8)
    w = torch.ones(8)  # not declared static: the replay could not rely on it
    with pytest.raises(graph.CaptureError, match="argument 10 of hs_rms_norm .* points outside"):
        graph.capture(lambda: pointwise.rms_norm(x, w, 1e-6), [graph.tensor_region(x)])


def test_a_function_without_kernel_calls_is_refused(lib):
    x = torch.randn(2, 8)
    with pytest.raises(graph.CaptureError, match="no kernel call"):
        graph.capture(lambda: x.view(16), [graph.tensor_region(x)])


def test_a_failing_replayed_call_is_named(lib):
    table = torch.randn(10, 4)
    ids = torch.tensor([1, 2], dtype=torch.int64)
    g = graph.capture(lambda: pointwise.gather_rows(table, ids), [graph.tensor_region(table), graph.tensor_region(ids)])
    g.place(torch.empty(g.arena_bytes, dtype=torch.uint8))
    assert torch.equal(g.replay(), table[ids])
    ids[1] = 10  # outside the table: the kernel refuses, writing nothing
    with pytest.raises(RuntimeError, match=r"captured call 0 of 1 \(hs_gather_rows\) failed \(code 1\)"):
        g.replay()


def test_gather_rows_rounds_as_pytorch(lib):
    table = torch.randn(50, 24, dtype=torch.bfloat16)
    ids = torch.tensor([0, 49, 7, 7], dtype=torch.int64)
    assert torch.equal(pointwise.gather_rows(table, ids), table[ids])
    assert torch.equal(pointwise.gather_rows(table, ids, 12.0), table[ids] * 12.0)
    with pytest.raises(RuntimeError, match="outside the table"):
        pointwise.gather_rows(table, torch.tensor([50]))


def test_kernels_check_their_argument_count_and_types(lib):
    with pytest.raises(TypeError, match=r"hs_silu_mul takes 9 arguments \(illplplwl\), got 2"):
        lib.hs_silu_mul(1, 2)
    with pytest.raises(Exception, match="int expected|wrong type"):  # a float where an int64 goes
        lib.hs_silu_mul(0, 1.5, 8, 0, 8, 0, 8, 0, 8)


def _declared_kernels() -> dict[str, str]:
    """name -> parameter list of every kernel declared in csrc/kernels.h."""
    text = (build.SOURCE_DIR / "kernels.h").read_text()
    text = re.sub(r"//[^\n]*", "", text)
    return {m.group(1): m.group(2) for m in re.finditer(r"\bint\s+(hs_\w+)\(([^)]*)\);", text)}


def test_every_declared_kernel_is_registered_once_with_its_signature(lib):
    from hybridserve.kernels import LIBRARIES

    registered: dict[str, str] = {}
    for name in LIBRARIES:
        bound = _abi.bind(name)
        assert bound is not None, build.unavailable_reason(name)
        for fn, kernel in bound.kernels.items():
            assert fn not in registered, f"{fn} registered twice"
            registered[fn] = kernel.signature
    declared = _declared_kernels()
    assert set(registered) == set(declared)
    codes = {"int": "i", "int64_t": "l", "float": "f"}
    for fn, params in declared.items():
        expected = ""
        for param in filter(None, (p.strip() for p in params.split(","))):
            kind = param.rsplit(" ", 1)[0].strip() if "*" not in param else ("p" if param.startswith("const") else "w")
            expected += codes.get(kind, kind)
        assert registered[fn] == expected, fn
