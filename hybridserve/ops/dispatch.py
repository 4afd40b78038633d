"""Fast or plain, chosen once: every op entry in ``hybridserve.ops`` runs its compiled CPU kernel body or
its plain-PyTorch body, and the choice is made once per model, not in the layers.

The engine decides at start whether a model runs on the kernels (``kernels.enable_cpu_kernels``, which
calls :func:`run_on_kernels`). From then on every call of that model (and of any other module so marked)
runs inside :func:`use_kernels`, a scope held in a context variable: two engines in one process, one on
the kernels and one plain, each see their own choice, and code outside any model's call (the sampler,
the acceptance of drafts) enters the scope itself from the engine's flag.

An op entry hands :func:`call` its two bodies. The kernel body returns None (or False) when it cannot
take the call (a dtype or shape it does not cover, a library that did not load); the plain body then
runs and the decline is counted by op and reason in ``kernels/fallbacks.py`` (the report of
``hybridserve env --model`` and the server's ``/metrics``), its first of each kind logged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from typing import TypeVar

from torch import nn

from hybridserve.cache.state_codec import StateView
from hybridserve.kernels import fallbacks

T = TypeVar("T")

_kernels: ContextVar[bool] = ContextVar("hybridserve_cpu_kernels", default=False)

#: the attribute naming a module whose calls run on the kernels (its hook handles)
_HOOKS = "_hybridserve_kernel_scope"


def kernels_on() -> bool:
    """Whether the op entries called now run their compiled CPU kernel bodies."""
    return _kernels.get()


@contextmanager
def use_kernels(on: bool = True) -> Iterator[None]:
    """Run the op entries called inside on the compiled kernels (``on``) or in plain PyTorch."""
    token = _kernels.set(on)
    try:
        yield
    finally:
        _kernels.reset(token)


def call(op: str, kernel: Callable[[], T | None], plain: Callable[[], T], *inputs: StateView | None
         ) -> T:
    """``kernel()`` when the kernels are on and it takes the call, else ``plain()``; a decline (None or
    False from ``kernel``) is recorded under ``op`` with the ``inputs``' dtypes and layouts as the reason."""
    if _kernels.get():
        out = kernel()
        if out is not None and out is not False:
            return out
        fallbacks.record(op, fallbacks.describe(*inputs))
    return plain()


def declined(op: str, reason: str) -> None:
    """Record that ``op`` runs its plain body for ``reason`` (only while the kernels are on)."""
    if _kernels.get():
        fallbacks.record(op, reason)


def run_on_kernels(module: nn.Module) -> None:
    """Make every call of ``module`` (``module(...)``) run inside ``use_kernels(True)``, whatever thread or
    engine calls it. Marking a module twice is harmless."""
    if getattr(module, _HOOKS, None) is not None:
        return
    tokens = threading.local()

    def enter(_module: nn.Module, _args: tuple) -> None:
        stack: list[Token[bool]] = tokens.__dict__.setdefault("stack", [])
        stack.append(_kernels.set(True))

    def leave(_module: nn.Module, _args: tuple, _output: object) -> None:
        _kernels.reset(tokens.stack.pop())

    handles = (module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True))
    object.__setattr__(module, _HOOKS, handles)


def runs_on_kernels(module: nn.Module) -> bool:
    """Whether :func:`run_on_kernels` marked ``module``."""
    return getattr(module, _HOOKS, None) is not None
