"""Compiling a request's grammar: once per request, in one worker thread (never on the server's event loop nor in
the engine's step loop), within ``GrammarLimits`` (see docs/structured_output.md, "Limits").

A compiled grammar is attached to the request's :class:`StructuredOutputsParams` (``compiled``), so the engine
reuses what the server compiled, and kept in a cache bounded in estimated bytes for later requests."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from hybridserve.structured_output import backend
from hybridserve.structured_output.grammar_cache import GrammarCache
from hybridserve.structured_output.limits import (
    GrammarLimitError,
    GrammarLimits,
    check_grammar_size,
    compile_timeout_error,
)
from hybridserve.structured_output.params import StructuredOutputsParams

#: the size estimate of a compiled grammar: the process's resident-memory growth while it compiled and was
#: probed, plus this much per entry and per character of llguidance's grammar text (its own structures, which a
#: reused heap may not show as growth)
ENTRY_BASE_BYTES = 16 * 2 ** 10
BYTES_PER_GRAMMAR_CHAR = 32


@dataclass(eq=False)
class CompiledGrammar:
    """One grammar compiled on one compiler's tokenizer: ``template`` (an llguidance matcher at its start, never
    advanced), the constraint's ``key``, ``size_bytes`` (the estimate of its memory) and ``owner``, the identity of
    the compiler that made it (not the compiler itself: params holding this keep no engine's cache alive)."""

    template: Any
    key: tuple[str, str]
    size_bytes: int
    owner: object

    def new_matcher(self) -> Any:
        """A fresh llguidance matcher of this grammar, at its start."""
        return self.template.deep_copy()


class GrammarCompiler:
    """Compiles the grammars of one engine's requests within ``limits``.

    Compilation runs in a single worker thread, so at most one core compiles at a time and the caller's thread
    (the event loop, or the engine's) only waits. A request waits at most ``max_grammar_compile_seconds`` for its
    grammar, queueing included: past it, GrammarLimitError (a compile still queued is cancelled; one already
    running finishes in the worker and is cached). Each new grammar is probed: its first mask is computed and its
    first allowed token consumed, on a copy, so a grammar over llguidance's parser limits is refused at compile
    time rather than failing its request at the first token. ``num_compiles`` counts the grammars compiled."""

    def __init__(self, hf_tokenizer: Any | None, vocab_size: int, eos_token_id: int | None,
                 limits: GrammarLimits | None = None) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.limits = limits or GrammarLimits()
        self.cache = GrammarCache(self.limits.grammar_cache_bytes)
        self.num_compiles = 0
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._tokenizer: Any | None = None  # llguidance's view of hf_tokenizer, made by the worker at its first compile
        self._identity = object()  # what its CompiledGrammars name as their owner

    # ------------------------------------------------------------------ callers
    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """``spec``'s compiled grammar: the one attached to it, a cached one, or compiled now (waiting in this
        thread). ValueError naming the field if it does not compile; GrammarLimitError past a limit."""
        key = spec.key()
        found = self._attached(spec, key)
        if found is not None:
            return found
        future = self.submit(spec, key)
        try:
            compiled = future.result(timeout=self.limits.max_grammar_compile_seconds)
        except FutureTimeout:
            future.cancel()
            raise compile_timeout_error(key[0], self.limits) from None
        spec.compiled = compiled
        return compiled

    async def compile_async(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """:meth:`compile` for an asyncio caller: the loop keeps running while the worker compiles."""
        key = spec.key()
        found = self._attached(spec, key)
        if found is not None:
            return found
        future = self.submit(spec, key)
        try:
            compiled = await asyncio.wait_for(asyncio.wrap_future(future), self.limits.max_grammar_compile_seconds)
        except asyncio.TimeoutError:
            future.cancel()
            raise compile_timeout_error(key[0], self.limits) from None
        spec.compiled = compiled
        return compiled

    def submit(self, spec: StructuredOutputsParams, key: tuple[str, str] | None = None) -> Future:
        """A future of ``spec``'s compiled grammar (done at once if cached; ``key``: ``spec.key()`` if the caller
        has it). Checks the size limit first, in the caller's thread: GrammarLimitError if the constraint's text
        is over ``max_grammar_bytes``."""
        if self.hf_tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer, and this engine has none")
        key = spec.key() if key is None else key
        check_grammar_size(key[0], key[1], self.limits)
        found = self.cache.get(key)
        if found is not None:
            done: Future = Future()
            done.set_result(found)
            return done
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridserve-grammar")
            return self._executor.submit(self._compile_now, spec, key)

    def close(self) -> None:
        """Stop the worker: queued compiles are cancelled (one running finishes in the background)."""
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None

    def _attached(self, spec: StructuredOutputsParams, key: tuple[str, str]) -> CompiledGrammar | None:
        found = spec.compiled
        if isinstance(found, CompiledGrammar) and found.owner is self._identity and found.key == key:
            return found
        return None

    # ------------------------------------------------------------ worker thread
    def _ll_tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = backend.ll_tokenizer(self.hf_tokenizer, self.vocab_size, self.eos_token_id)
        return self._tokenizer

    def _compile_now(self, spec: StructuredOutputsParams, key: tuple[str, str]) -> CompiledGrammar:
        tokenizer = self._ll_tokenizer()
        before = _resident_bytes()
        grammar = backend.grammar_text(spec)
        template = backend.llguidance_module().LLMatcher(tokenizer, grammar, log_level=0)
        invalid = backend.short_error(template.get_error()) if template.is_error() else None
        over_limits = None if invalid else first_token_error(template)
        if invalid or over_limits:
            del template  # freed now, not when the collector reaches the exception's frames
            if invalid:
                raise ValueError(f"structured_outputs.{spec.kind} is not valid: {invalid}")
            raise GrammarLimitError(f"structured_outputs.{spec.kind} is over the grammar engine's limits "
                                    f"(llguidance's parser limits, met at its first token): {over_limits}; "
                                    "simplify it")
        grown = max(0, _resident_bytes() - before)
        compiled = CompiledGrammar(template, key, grown + ENTRY_BASE_BYTES + BYTES_PER_GRAMMAR_CHAR * len(grammar),
                                   self._identity)
        with self._lock:
            self.num_compiles += 1
        self.cache.put(key, compiled)
        return compiled


def first_token_error(template: Any) -> str | None:
    """The probe: compute the first mask of a copy of ``template`` and consume its first allowed token; the
    error (naming llguidance's limit) if either fails, which would otherwise fail the request at its first token,
    else None."""
    probe = template.deep_copy()
    mask = probe.compute_bitmask()
    if not probe.is_error():
        allowed = int.from_bytes(mask, "little")
        if allowed == 0:
            return "no token is allowed at its start"
        probe.consume_token((allowed & -allowed).bit_length() - 1)  # the lowest allowed token id
    return backend.short_error(probe.get_error()) if probe.is_error() else None


def _resident_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
