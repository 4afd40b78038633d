"""Adaptive thread counts (``kernels/thread_share.py``, ``cpu_adaptive_threads``): the count for a measured
load, /proc/stat read for this process's CPUs only, the load measured net of this process's own CPU time,
the engine applying a change between steps with the same outputs, and the option validated. The loads here
are scripted (fake /proc/stat, clock and CPU times); benchmarks/shared_cores.py measures real neighbours."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridserve.config import EngineConfig
from hybridserve.entrypoints.cli import build_parser
from hybridserve.entrypoints.engine_args import engine_kwargs
from hybridserve.kernels import thread_share
from hybridserve.kernels.thread_share import ThreadShare, busy_ticks, threads_for


@pytest.mark.parametrize("ceiling,others,want", [
    (2, 0.0, 2), (2, 0.3, 2), (2, 0.59, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 1.5, 1),
    (2, 1.6, 2),  # both cores taken: one thread would get less than two threads' share
    (2, 2.0, 2), (1, 1.0, 1), (16, 1.0, 15), (16, 8.0, 8), (16, 8.5, 8), (16, 9.0, 16), (16, -1.0, 16),
])
def test_the_count_is_the_free_cores_down_to_half(ceiling, others, want):
    assert threads_for(ceiling, others) == want


def test_a_core_left_to_the_front_end_absorbs_its_load():
    """3 threads on 4 cores (one reserved): the front end's busy core is the reserved one, not one of ours."""
    assert threads_for(3, 1.0, cores=4) == 3
    assert threads_for(3, 2.0, cores=4) == 2
    assert threads_for(3, 3.0, cores=4) == 3  # fewer than half left: every thread


def _stat(ticks: dict[int, tuple[int, ...]]) -> str:
    """A /proc/stat text: the aggregate line, then per CPU: user nice system idle iowait irq softirq steal."""
    total = [sum(v[i] for v in ticks.values()) for i in range(8)]
    lines = ["cpu  " + " ".join(map(str, total))]
    lines += [f"cpu{c} " + " ".join(map(str, v)) + " 0 0" for c, v in sorted(ticks.items())]
    return "\n".join(lines + ["intr 12345 0 0", "ctxt 999", "btime 1"]) + "\n"


def test_busy_ticks_count_the_given_cpus_and_every_busy_field():
    text = _stat({0: (1, 2, 3, 1000, 50, 4, 5, 6), 1: (10, 0, 0, 7, 0, 0, 0, 0), 2: (100, 0, 0, 0, 0, 0, 0, 0)})
    assert busy_ticks({0}, text) == 1 + 2 + 3 + 4 + 5 + 6  # idle and iowait are not busy
    assert busy_ticks({0, 1}, text) == 21 + 10
    assert busy_ticks({3}, text) == 0


class _Machine:
    """Scripted sources: a clock, per-CPU busy ticks (100 a second) and this process's CPU and run-queue
    seconds, for 2 CPUs shared out alike among the runnable threads (and a third CPU outside the mask)."""

    def __init__(self) -> None:
        self.now, self.ran, self.waited, self.busy = 0.0, 0.0, 0.0, {0: 0, 1: 0, 2: 0}

    def run(self, seconds: float, threads: int, others: float, elsewhere: float = 0.0) -> None:
        """``seconds`` pass with ``threads`` of this process and ``others`` threads of other processes
        runnable on CPUs 0-1, and ``elsewhere`` busy cores on CPU 2."""
        share = min(1.0, 2 / (threads + others)) if threads + others else 1.0  # of each runnable thread's time
        self.now += seconds
        self.ran += threads * share * seconds
        self.waited += threads * (1.0 - share) * seconds
        for cpu, cores in ((0, (threads + others) * share / 2), (1, (threads + others) * share / 2), (2, elsewhere)):
            self.busy[cpu] += round(cores * seconds * 100)

    def share(self, ceiling: int) -> ThreadShare:
        return ThreadShare(ceiling, 2, {0, 1}, clock=lambda: self.now, own=lambda: (self.ran, self.waited),
                           read_stat=lambda: _stat({c: (b, 0, 0, 0, 0, 0, 0, 0) for c, b in self.busy.items()}),
                           ticks_per_second=100)


def test_one_neighbour_takes_a_thread_and_gives_it_back(caplog):
    m = _Machine()
    share = m.share(2)
    m.run(0.1, threads=2, others=0)
    assert share.poll() is None  # before an interval has passed nothing is read
    m.run(0.5, threads=2, others=0, elsewhere=1.0)  # load outside this process's CPUs is not counted
    assert share.poll() is None and share.others == pytest.approx(0.0, abs=0.02)
    m.run(0.5, threads=2, others=1)  # a neighbour arrives: three runnable threads on two cores
    with caplog.at_level(logging.INFO, logger=thread_share.__name__):
        assert share.poll() == 1
    assert share.others == pytest.approx(1.0, abs=0.03)
    assert "CPU threads 2 -> 1: other processes wanted 1.0 of this process's 2 CPUs" in caplog.text
    m.run(0.5, threads=1, others=1)  # one thread beside it: the neighbour still reads as 1
    assert share.poll() is None and share.current == 1 and share.others == pytest.approx(1.0, abs=0.03)
    m.run(0.5, threads=1, others=0)  # it left
    assert share.poll() == 2 and share.changes == 2


def test_two_neighbours_leave_every_thread():
    """Two busy neighbours want both cores: one thread would get 2/3 of a core where two get one."""
    m = _Machine()
    share = m.share(2)
    m.run(0.5, threads=2, others=2)
    assert share.poll() is None and share.others == pytest.approx(2.0, abs=0.05)
    share.current = 1  # had one neighbour, then a second came
    m.run(0.5, threads=1, others=2)
    assert share.poll() == 2 and share.others == pytest.approx(2.0, abs=0.05)


def test_own_times_read_this_process():
    ran, waited = thread_share.own_times()
    assert ran > 0.0 and waited >= 0.0


def test_the_option_is_validated_and_passed_by_the_cli():
    assert EngineConfig(model="x").cpu_adaptive_threads is False
    with pytest.raises(ValueError, match="cpu_adaptive_threads='yes' must be True or False"):
        EngineConfig(model="x", cpu_adaptive_threads="yes")
    with pytest.raises(ValueError, match="cpu_adaptive_threads=True runs in one process; with tensor_parallel_size=2"):
        EngineConfig(model="x", cpu_adaptive_threads=True, tensor_parallel_size=2, device="cpu")
    args = build_parser().parse_args(["generate", "hi", "--cpu-adaptive-threads"])
    assert engine_kwargs(args)["cpu_adaptive_threads"] is True
    assert engine_kwargs(build_parser().parse_args(["serve"]))["cpu_adaptive_threads"] is False


def _agree_up_to_near_ties(a, b) -> None:
    """Greedy completions a and b (RequestOutputs with logprobs) are equal, or part at a near tie: each side's
    token among the other's top logprobs (torch's operators may split a sum differently at another count)."""
    for x, y in zip(a, b):
        cx, cy = x.outputs[0], y.outputs[0]
        assert len(cx.token_ids) == len(cy.token_ids)
        for pos, (tx, ty) in enumerate(zip(cx.token_ids, cy.token_ids)):
            if tx != ty:
                assert tx in cy.logprobs[pos] and ty in cx.logprobs[pos], (pos, tx, ty)
                break


def test_the_engine_changes_threads_between_steps(ckpt_dir):
    """A scripted neighbour comes and goes during a generation: the engine steps with 1 thread, then 2 again,
    and its greedy tokens are a fixed 2-thread run's (the compiled kernels split output columns between
    threads, never a sum), up to near ties."""
    from hybridserve import LLM, SamplingParams
    from tests.checkpoints import make

    before = torch.get_num_threads()
    try:
        path = make(ckpt_dir, "granitemoehybrid")
        opts = dict(cpu_threads=2, enable_progress_bar=False, cache_memory="16MiB", max_num_seqs=2)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
        prompts = [{"prompt_token_ids": [5, 9, 14, 3, 77, 21, 8]}, {"prompt_token_ids": [60, 61, 62]}]
        fixed = LLM(path, **opts).generate(prompts, params)
        llm = LLM(path, cpu_adaptive_threads=True, **opts)
        m = _Machine()
        share = llm.engine.thread_share = m.share(2)
        seen: list[int] = []
        step = llm.engine.step

        def scripted_step(*args, **kwargs):
            n = len(seen)
            m.run(0.25, threads=torch.get_num_threads(), others=1 if 4 <= n < 12 else 0)  # a neighbour, steps 4-11
            out = step(*args, **kwargs)
            seen.append(torch.get_num_threads())
            return out

        llm.engine.step = scripted_step
        adaptive = llm.generate(prompts, params)
        assert seen[:4] == [2] * 4 and 1 in seen and seen[-1] == 2 and share.changes == 2, seen
        _agree_up_to_near_ties(adaptive, fixed)
    finally:
        torch.set_num_threads(before)
