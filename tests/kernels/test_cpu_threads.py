"""The engine's CPU threads (``kernels/threads.py``): ``cpu_threads``, ``cpu_reserved_cores`` and
``cpu_wait_policy`` validated with errors that name the value and the allowed range, passed through by the
CLI, the thread count applied at engine start, and the wait policy put in the environment before torch
(and its OpenMP runtime) loads. No timings here: benchmarks/shared_cores.py measures."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from hybridserve.config import EngineConfig
from hybridserve.entrypoints.cli import apply_cpu_wait_policy_from_argv, build_parser, main
from hybridserve.entrypoints.engine_args import engine_kwargs
from hybridserve.kernels import threads

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def four_cores(monkeypatch):
    """A process that may use 4 cores (8 CPUs), whatever this machine has."""
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 8)


@pytest.fixture
def torch_threads():
    """Restore torch's thread count (and the engine's memory of it) after the test."""
    before, state = torch.get_num_threads(), (threads._torch_baseline, threads._last_set)
    yield
    torch.set_num_threads(before)
    threads._torch_baseline, threads._last_set = state


@pytest.mark.parametrize(("options", "message"), [
    ({"cpu_threads": 0}, "cpu_threads=0 is not valid; allowed: auto or 1 to 8"),
    ({"cpu_threads": 9}, "cpu_threads=9 is not valid; allowed: auto or 1 to 8"),
    ({"cpu_threads": "two"}, "cpu_threads='two' is not valid; allowed: auto or 1 to 8"),
    ({"cpu_threads": True}, "cpu_threads=True is not valid"),
    ({"cpu_threads": 8, "cpu_reserved_cores": 1}, "cpu_threads=8 is not valid; allowed: auto or 1 to 7"),
    ({"cpu_reserved_cores": -1}, "cpu_reserved_cores=-1 is not valid; allowed: 0 to 3"),
    ({"cpu_reserved_cores": 4}, "cpu_reserved_cores=4 is not valid; allowed: 0 to 3"),
    ({"cpu_reserved_cores": "1"}, "cpu_reserved_cores='1' is not valid; allowed: 0 to 3"),
    ({"cpu_wait_policy": "sometimes"},
     "cpu_wait_policy='sometimes' is not valid; allowed values: auto, spin, bounded, passive, openmp"),
])
def test_bad_thread_options_name_the_value_and_the_range(four_cores, options, message):
    with pytest.raises(ValueError) as err:
        EngineConfig(model="x", **options)
    assert message in str(err.value)


def test_thread_options_are_normalised(four_cores):
    config = EngineConfig(model="x", cpu_threads="auto", cpu_reserved_cores=3, cpu_wait_policy="PASSIVE")
    assert (config.cpu_threads, config.cpu_reserved_cores, config.cpu_wait_policy) == (None, 3, "passive")
    assert EngineConfig(model="x", cpu_threads=8).cpu_threads == 8  # SMT siblings may be used when asked
    # the wait policy never changes results; the thread count stays in the fingerprint
    assert EngineConfig(model="x").fingerprint() == EngineConfig(model="x", cpu_wait_policy="spin").fingerprint()


def test_the_cli_passes_the_options_through():
    args = build_parser().parse_args(["generate", "hi", "--cpu-threads", "2", "--cpu-reserved-cores", "1",
                                      "--cpu-wait-policy", "passive"])
    kwargs = engine_kwargs(args)
    assert (kwargs["cpu_threads"], kwargs["cpu_reserved_cores"], kwargs["cpu_wait_policy"]) == (2, 1, "passive")
    args = build_parser().parse_args(["serve", "--cpu-threads", "auto"])
    assert (args.cpu_threads, args.cpu_reserved_cores, args.cpu_wait_policy) == (None, 0, "auto")


def test_the_cli_refuses_bad_values(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--cpu-threads", "two"])
    assert "'two' is not a thread count (an integer, or auto)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--cpu-wait-policy", "sometimes"])
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err
    top = threads.usable_cpus()
    assert main(["generate", "hi", "--cpu-threads", str(top + 1)]) == 2  # refused before any model loads
    assert f"cpu_threads={top + 1} is not valid; allowed: auto or 1 to {top}" in capsys.readouterr().err


def test_thread_count_resolution(four_cores):
    assert threads.resolve_threads(None, 0, torch_threads=4) == (4, "auto: 4 cores usable")
    assert threads.resolve_threads(None, 1, torch_threads=4) == (3, "auto: 4 cores usable, 1 left to the front end")
    count, reason = threads.resolve_threads(None, 0, torch_threads=1)  # lowered before the engine started: kept
    assert count == 1 and "torch was set to 1" in reason
    assert threads.resolve_threads(6, 0, torch_threads=1) == (6, "cpu_threads")


def test_setup_threads_applies_the_count_and_forgets_its_own(four_cores, torch_threads):
    torch.set_num_threads(1)
    assert threads.setup_threads(2).threads == 2 and torch.get_num_threads() == 2
    # auto goes back to what torch had before the engine changed it, not to the last engine's count
    assert threads.setup_threads(None).threads == 1 and torch.get_num_threads() == 1
    torch.set_num_threads(3)  # someone else changed it: that is the new baseline
    assert threads.setup_threads(None, 1).threads == 3
    assert threads.setup_threads(None, 0).threads == 3


def test_an_engine_applies_its_thread_count(ckpt_dir, torch_threads):
    from hybridserve import LLM
    from tests.checkpoints import make

    torch.set_num_threads(1)
    llm = LLM(make(ckpt_dir, "mamba2"), cpu_threads=2, enable_progress_bar=False, cache_memory="16MiB")
    assert torch.get_num_threads() == 2 and llm.engine.thread_setup.threads == 2


def test_spin_counts_follow_libgomp():
    assert threads.gomp_spin_count({}) == 300_000
    assert threads.gomp_spin_count({"OMP_WAIT_POLICY": "passive"}) == 0
    assert threads.gomp_spin_count({"OMP_WAIT_POLICY": "ACTIVE"}) == 30_000_000_000
    assert threads.gomp_spin_count({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10k"}) == 10_000  # it wins
    assert threads.gomp_spin_count({"GOMP_SPINCOUNT": "infinite"}) == 2**64 - 1
    for policy in ("spin", "bounded", "passive", "openmp"):
        assert threads.policy_of(threads.wait_policy_environment(policy)) == policy
    assert threads.policy_of({"GOMP_SPINCOUNT": "77"}) == "custom"
    assert threads.wait_policy_environment("auto") == threads.wait_policy_environment(threads.AUTO_WAIT_POLICY)


def test_after_torch_loads_the_policy_is_reported_not_changed(monkeypatch, caplog):
    """The offline API's case: torch (and OpenMP) loaded before any engine; nothing is set, a warning says why."""
    monkeypatch.setattr(threads, "_applied", None)
    for name in threads.WAIT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    state = threads.apply_wait_policy("passive")
    assert not any(os.environ.get(name) for name in threads.WAIT_VARIABLES)
    assert state.in_force == "openmp" and state.source == "runtime default"
    assert "cpu_wait_policy=passive is not in force (openmp is)" in state.note
    assert "before importing torch" in state.note
    with caplog.at_level(logging.INFO, logger="hybridserve.kernels.threads"):
        threads.setup_threads(None, 0, "passive")
    assert any(r.levelno == logging.WARNING and "is not in force" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")  # the user's own choice, under auto: no complaint
    assert threads.wait_policy_in_force("auto").note is None
    assert threads.wait_policy_in_force("auto").source == "environment"


def test_env_reports_threads_and_the_wait_policy(capsys, torch_threads):
    assert main(["env", "--json", "--cpu-threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out)["cpu_threads"]
    assert report["threads"] == 1 == torch.get_num_threads() and report["reason"] == "cpu_threads"
    assert report["wait_policy"]["in_force"] in threads.WAIT_POLICIES + ("custom",)
    assert report["cores"] == threads.usable_cores() and report["cpus"] == threads.usable_cpus()


def test_argv_scan_is_only_for_engine_commands(monkeypatch):
    seen = []
    monkeypatch.setattr(threads, "apply_wait_policy", seen.append)
    apply_cpu_wait_policy_from_argv(["plan", "dir"])
    apply_cpu_wait_policy_from_argv(["generate", "hi"])
    apply_cpu_wait_policy_from_argv(["serve", "--cpu-wait-policy=passive"])
    apply_cpu_wait_policy_from_argv(["env", "--cpu-wait", "spin"])  # argparse takes a unique prefix too
    apply_cpu_wait_policy_from_argv(["env", "--cpu-wait-policy", "bogus"])  # left to the parser
    assert seen == ["auto", "passive", "spin"]


def _run_env(extra_env: dict[str, str], *args: str) -> tuple[dict, str]:
    """``hybridserve env --json ARGS`` in a fresh process with libgomp printing what it read at load."""
    env = {k: v for k, v in os.environ.items() if k not in threads.WAIT_VARIABLES}
    env.update({"OMP_DISPLAY_ENV": "VERBOSE", "PYTHONPATH": REPO_ROOT, **extra_env})
    proc = subprocess.run([sys.executable, "-m", "hybridserve.entrypoints.cli", "env", "--json", *args],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["cpu_threads"], proc.stderr


@pytest.mark.parametrize(("extra_env", "args", "in_force", "source", "omp_wait", "spins"), [
    ({}, (), threads.AUTO_WAIT_POLICY, "option", None, None),  # the default: auto
    ({}, ("--cpu-wait-policy", "passive"), "passive", "option", "PASSIVE", 0),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, (), "spin", "environment", "ACTIVE", None),  # the user's, kept under auto
    ({"OMP_WAIT_POLICY": "ACTIVE"}, ("--cpu-wait-policy", "passive"), "passive", "option", "PASSIVE", 0),
])
def test_the_command_sets_the_policy_before_torch_loads(extra_env, args, in_force, source, omp_wait, spins):
    report, stderr = _run_env(extra_env, *args)
    policy = report["wait_policy"]
    assert (policy["in_force"], policy["source"]) == (in_force, source)
    if report["openmp_runtime"] != "libgomp" or "OPENMP DISPLAY ENVIRONMENT BEGIN" not in stderr:
        pytest.skip(f"the OpenMP runtime ({report['openmp_runtime']}) does not display what it read")
    # what libgomp itself read when torch loaded it
    expected = spins if spins is not None else threads.gomp_spin_count(threads.wait_policy_environment(in_force))
    assert f"GOMP_SPINCOUNT = '{expected}'" in stderr
    if omp_wait is not None:
        assert f"OMP_WAIT_POLICY = '{omp_wait}'" in stderr
