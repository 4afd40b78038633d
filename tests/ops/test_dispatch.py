"""The fast/plain choice of ``ops/dispatch.py``: made once per model (its calls run inside the kernels'
scope), seen by every op entry it calls, left behind when the call ends (even by an exception), private to
the call tree and thread that made it, and every decline counted in ``kernels/fallbacks.py``."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from hybridserve.kernels import fallbacks
from hybridserve.ops.dispatch import call, declined, kernels_on, run_on_kernels, runs_on_kernels, use_kernels


class Probe(nn.Module):
    """Records whether the kernels were on during each call; optionally calls an inner module or raises."""

    def __init__(self, inner: nn.Module | None = None, fail: bool = False) -> None:
        super().__init__()
        self.inner, self.fail, self.seen = inner, fail, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(kernels_on())
        if self.fail:
            raise RuntimeError("boom")
        return self.inner(x) if self.inner is not None else x


@pytest.fixture
def counts():
    fallbacks.reset()
    yield fallbacks.counts
    fallbacks.reset()


def test_call_runs_the_plain_body_when_the_kernels_are_off(counts):
    ran = []
    out = call("op_a", lambda: ran.append("kernel") or torch.ones(1), lambda: torch.zeros(1), None)
    assert ran == [] and torch.equal(out, torch.zeros(1)) and counts() == {}


def test_call_runs_the_kernel_body_in_the_kernels_scope(counts):
    with use_kernels(True):
        out = call("op_a", lambda: torch.ones(1), lambda: torch.zeros(1))
    assert torch.equal(out, torch.ones(1)) and counts() == {}
    assert not kernels_on()  # the scope ended


@pytest.mark.parametrize("declines", [None, False])
def test_a_declined_call_runs_the_plain_body_and_is_counted(counts, declines):
    x = torch.zeros(2, 3, dtype=torch.bfloat16)
    with use_kernels(True):
        out = call("op_b", lambda: declines, lambda: "plain", x)
        call("op_b", lambda: declines, lambda: "plain", x)
    assert out == "plain"
    assert counts() == {("op_b", "bfloat16 rows"): 2}


def test_declined_counts_only_while_the_kernels_are_on(counts):
    declined("op_c", "not covered")
    assert counts() == {}
    with use_kernels(True):
        declined("op_c", "not covered")
    assert counts() == {("op_c", "not covered"): 1}


def test_a_marked_model_runs_on_the_kernels_and_an_unmarked_one_beside_it_does_not():
    inner = Probe()
    fast, plain = Probe(inner), Probe()
    run_on_kernels(fast)
    run_on_kernels(fast)  # twice: harmless
    x = torch.zeros(1)
    fast(x), plain(x), fast(x)
    assert fast.seen == [True, True] and inner.seen == [True, True]  # its whole call tree
    assert plain.seen == [False]
    assert not kernels_on()
    assert runs_on_kernels(fast) and not runs_on_kernels(plain) and not runs_on_kernels(inner)


def test_the_scope_ends_when_the_call_raises():
    failing = Probe(fail=True)
    run_on_kernels(failing)
    with pytest.raises(RuntimeError, match="boom"):
        failing(torch.zeros(1))
    assert failing.seen == [True]
    assert not kernels_on()


def test_the_choice_is_private_to_the_thread_that_calls():
    """A thread running a marked model does not switch the kernels on for another thread's plain model."""
    fast, plain = Probe(), Probe()
    run_on_kernels(fast)
    inside, leave = threading.Event(), threading.Event()

    def run_fast() -> None:
        def body(x: torch.Tensor) -> torch.Tensor:
            inside.set()
            assert leave.wait(10)
            return x
        fast.inner = nn.Module()
        fast.inner.forward = body  # type: ignore[method-assign]
        fast(torch.zeros(1))

    worker = threading.Thread(target=run_fast)
    worker.start()
    try:
        assert inside.wait(10)
        plain(torch.zeros(1))  # while the other thread is inside the marked model's call
    finally:
        leave.set()
        worker.join(10)
    assert not worker.is_alive()
    assert fast.seen == [True] and plain.seen == [False]
