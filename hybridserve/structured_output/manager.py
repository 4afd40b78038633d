"""The engine's structured output: has each request's grammar compiled when it is added (by its
:class:`GrammarCompiler`, unless the server compiled it already), keeps one matcher per sequence while it runs,
and tells the engine each step's masks and when a grammar is complete."""

from __future__ import annotations

from typing import Any

from hybridserve.sampling_params import SamplingParams
from hybridserve.structured_output.compiler import GrammarCompiler
from hybridserve.structured_output.limits import GrammarLimits
from hybridserve.structured_output.matcher import SequenceMatcher


class StructuredOutputManager:
    """Grammars and matchers of one engine.

    ``vocab_size`` is the model's logits width (``hf_config.vocab_size``, which may exceed the tokenizer's: ids
    the tokenizer lacks are never allowed; a tokenizer wider than the logits makes wider bitmasks, cut to the
    logits when applied).
    Matchers are keyed by sequence object and made at a sequence's first masked step (a fresh copy of the
    compiled grammar, advanced by any output the sequence already has), so ``n > 1`` children get their own;
    a preempted sequence keeps its output tokens and so its matcher. :meth:`release` drops them.
    """

    def __init__(self, hf_tokenizer: Any | None, vocab_size: int, eos_token_id: int | None,
                 limits: GrammarLimits | None = None) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        # the bitmasks' width: the logits' or, if larger, the tokenizer's
        self._mask_vocab = max(vocab_size, len(hf_tokenizer)) if hf_tokenizer is not None else vocab_size
        self.compiler = GrammarCompiler(hf_tokenizer, self._mask_vocab, eos_token_id, limits)
        self._matchers: dict[Any, SequenceMatcher] = {}

    def check(self, params: SamplingParams) -> None:
        """Compile the grammar of ``params`` (unless it is compiled already: by the server, or cached), within the
        grammar limits; ValueError naming the problem (GrammarLimitError naming the limit) if it fails."""
        if params.structured_outputs is not None:
            self.compiler.compile(params.structured_outputs)

    def matcher(self, seq: Any) -> SequenceMatcher:
        """The matcher of ``seq`` (a Sequence whose params have ``structured_outputs``), made on first use."""
        found = self._matchers.get(seq)
        if found is None:
            params = seq.params
            # the grammar engine knows one EOS id (the engine's first); the others end a complete output as the
            # request's stop tokens do
            ends = list(params.stop_token_ids or []) + sorted(t for t in seq.eos_token_ids if t != self.eos_token_id)
            found = SequenceMatcher(self.compiler.compile(params.structured_outputs).new_matcher(), self._mask_vocab,
                                    ends, self.eos_token_id)
            for token in seq.output_token_ids:  # none, unless the sequence already generated some
                found.accept(token)
            self._matchers[seq] = found
        return found

    def accept(self, seq: Any, token: int) -> None:
        """Advance ``seq``'s grammar by its new ``token`` (GrammarRefusedToken if it is not allowed)."""
        if seq.params.structured_outputs is not None:
            self.matcher(seq).accept(token)

    def finished(self, seq: Any) -> bool:
        """Whether ``seq`` is constrained and its grammar admits no further token."""
        found = self._matchers.get(seq)
        return found is not None and found.finished

    def release(self, seqs: list[Any]) -> None:
        """Forget the matchers of ``seqs`` (finished or aborted)."""
        for seq in seqs:
            self._matchers.pop(seq, None)

    def release_all(self) -> None:
        self._matchers.clear()

    def close(self) -> None:
        """Stop the grammar compiler's worker thread."""
        self.compiler.close()

    @property
    def num_matchers(self) -> int:
        """Matchers held now (0 once every constrained sequence has finished)."""
        return len(self._matchers)
