"""Builds each step's batch metadata and runs one batched forward for all scheduled sequences.

Sequences hold page and slot handles (:mod:`hybridserve.cache.handle_map`); the batch a forward reads holds
positions in the pool's views. The step is built in handles and translated here, with one gather each for
the block tables, the KV write rows and the state slots (a captured step translates its own buffers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridserve.cache.layout import kv_slot, kv_slots
from hybridserve.cache.pool import CachePool, LayerCache
from hybridserve.cache.state_codec import has_coded_state, rounding_key
from hybridserve.engine.decode_capture import CapturedDecode
from hybridserve.engine.scheduler import ScheduledSeq
from hybridserve.forward_batch import ForwardBatch, SeqGroup
from hybridserve.models.base import CausalLM


@dataclass
class StepLogits:
    """Logits of one step, split by use."""

    order: list[ScheduledSeq]  # the scheduled sequences in batch order (decodes first)
    sample_seqs: list[ScheduledSeq]  # sequences that reached their last token and sample now (no drafts)
    sample_logits: torch.Tensor | None  # (len(sample_seqs), V) float32, or the model dtype exactly widened to it
    prompt_seqs: list[tuple[ScheduledSeq, int, int]]  # (seq, first prompt position, count)
    prompt_logits: torch.Tensor | None  # (sum of counts, V) float32
    verify_seqs: list[ScheduledSeq] = field(default_factory=list)  # sequences whose drafts are verified now
    verify_logits: torch.Tensor | None = None  # (sum of (drafts + 1), V): each one's rows, as sample_logits
    hidden: torch.Tensor | None = None  # (T, hidden) final hidden states of every row (valid until the next step)
    starts: list[int] = field(default_factory=list)  # per sequence of ``order``: its first row's position
    offsets: list[int] = field(default_factory=list)  # per sequence of ``order``: its first row in ``hidden``


_HOST = torch.device("cpu")  # where the pool's handle maps live (cache/handle_map.py)


def _int_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def table_tensor(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """(S, width) int64 of block tables, padded with page 0; a released entry (-1, behind a window) reads
    as page 0 too (never read: the attention stops at the window)."""
    width = max(len(t) for t in tables)
    flat: list[int] = []
    for table in tables:
        flat += table
        flat += [0] * (width - len(table))
    out = _int_tensor(flat, device).view(len(tables), width)  # (S, width)
    released = any(table and table[0] < 0 for table in tables)  # released entries are a table's first ones
    return out.clamp_(min=0) if released else out


class ModelRunner:
    """Owns the model and the cache pool's views; turns a schedule into logits."""

    def __init__(self, model: CausalLM, pool: CachePool, device: torch.device,
                 caches: dict[int, LayerCache] | None = None) -> None:
        """``caches``: the layer caches the model's cache indices address (default: the pool's, by the same
        indices; a draft model sharing the pool gets its own view of the pool's layers)."""
        self.model = model
        self.pool = pool
        self.caches = pool.layer_caches if caches is None else caches
        self.device = device
        self.block_size = pool.layout.block_size
        self.has_kv = pool.layout.has_kv
        self.has_state = pool.layout.has_state
        self.has_window = pool.layout.has_window  # a window page group: sequences hold window tables too
        # 8-bit state: each step's groups carry the sequences' rounding keys (cache/state_codec.py)
        self.coded_state = has_coded_state(self.caches)
        self.captured_decode: CapturedDecode | None = None  # set by the engine when the model's decode is captured
        self.captured_steps: dict[int, CapturedDecode] = {}  # tokens per sequence (> 1) -> its captured steps

    def _group(self, items: list[ScheduledSeq], token_start: int, num_generated: int = 0) -> SeqGroup | None:
        if not items:
            return None
        if all(it.num_run == 1 for it in items):
            cu_seqlens = torch.arange(len(items) + 1, dtype=torch.int64, device=self.device)
        else:
            cu = [0]
            for it in items:
                cu.append(cu[-1] + it.num_run)
            cu_seqlens = _int_tensor(cu, self.device)
        seq_lens = [it.seq.num_computed_tokens + it.num_run for it in items]
        block_tables = self._tables([it.seq.block_table for it in items]) if self.has_kv else None
        window_tables = self._tables([it.seq.window_table for it in items]) if self.has_window else None
        state_indices = self._slots(_state_slots(items)) if self.has_state else None
        keys = self._rounding_keys([it.seq for it in items])
        return SeqGroup(token_start, token_start + sum(it.num_run for it in items), cu_seqlens,
                        _int_tensor(seq_lens, self.device), block_tables, state_indices, window_tables, num_generated,
                        keys)

    def _rounding_keys(self, seqs: list) -> torch.Tensor | None:
        """(S,) the sequences' rounding keys of 8-bit state (their seeds, 0 when unset); None without such state."""
        return _int_tensor(_keys(seqs), self.device) if self.coded_state else None

    def _tables(self, tables: list[list[int]]) -> torch.Tensor:
        """(S, width) page positions of block tables of page handles (gathered on the host, then moved)."""
        return self.pool.pages.positions(table_tensor(tables, _HOST)).to(self.device)

    def _rows(self, rows: list[int]) -> torch.Tensor:
        """(T,) KV rows in the pool's views of KV rows in handle space (``kv_slot`` of a block table)."""
        return self.pool.pages.kv_rows(_int_tensor(rows, _HOST), self.block_size).to(self.device)

    def _slots(self, slots: list) -> torch.Tensor:
        """(S,) slot positions of state slot handles."""
        return self.pool.slots.positions(_int_tensor(slots, _HOST)).to(self.device)

    def _replay(self, scheduled: list[ScheduledSeq]) -> StepLogits | None:
        """A decode-only step of sequences that sample now and want no prompt logprobs, replayed from
        its capture; None for any other step (it runs the general path)."""
        captured = self.captured_decode
        if captured is None or len(scheduled) > captured.max_rows:
            return None
        seqs = [item.seq for item in scheduled]
        if any(item.num_run != 1 for item in scheduled) or any(
                s.num_computed_tokens + 1 != s.num_tokens or s.wants_prompt_logprobs for s in seqs):
            return None
        input_ids = [s.output_token_ids[-1] if s.output_token_ids else s.prompt_token_ids[-1] for s in seqs]
        positions = [s.num_computed_tokens for s in seqs]
        bs = self.block_size
        if self.has_kv:
            slot_mapping = [kv_slot(s.block_table, p, bs) for s, p in zip(seqs, positions)]
            tables = [s.block_table for s in seqs]
        else:
            slot_mapping, tables = [], []
        window = None
        if self.has_window:
            window = ([kv_slot(s.window_table, p, bs) for s, p in zip(seqs, positions)],
                      [s.window_table for s in seqs])
        hidden = captured.run(input_ids, positions, slot_mapping, [p + 1 for p in positions], tables,
                              _state_slots(scheduled) if self.has_state else [], window,
                              _keys(seqs) if self.coded_state else None)
        return StepLogits(list(scheduled), list(scheduled), self.model.sampling_logits(hidden), [], None,
                          hidden=hidden, starts=positions, offsets=list(range(len(scheduled))))

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> StepLogits:
        """One forward over every scheduled sequence (decodes first, then prefill chunks and verifications)."""
        replayed = self._replay(scheduled)
        if replayed is not None:
            return replayed
        decodes = [s for s in scheduled if s.num_run == 1]
        chunks = [s for s in scheduled if s.num_run > 1]
        generated = [s for s in chunks if _generated(s)]  # verifications and reruns first: see SeqGroup.num_generated
        prompt_chunks = [s for s in chunks if not _generated(s)]
        if not prompt_chunks:  # by token count: each count's sequences may replay one capture
            generated.sort(key=lambda s: s.num_run)
        prefills = generated + prompt_chunks
        order = decodes + prefills
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        window_slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[ScheduledSeq] = []
        verify_rows: list[int] = []
        verify_seqs: list[ScheduledSeq] = []
        prompt_rows: list[int] = []
        prompt_seqs: list[tuple[ScheduledSeq, int, int]] = []
        starts: list[int] = []
        offsets: list[int] = []
        bs = self.block_size
        for item in order:
            seq, start, n, m = item.seq, item.seq.num_computed_tokens, item.num_tokens, len(item.drafts)
            offset = len(input_ids)
            starts.append(start)
            offsets.append(offset)
            input_ids.extend(seq.token_ids_slice(start, n))
            input_ids.extend(item.drafts)
            end = start + n + m
            positions.extend(range(start, end))
            if self.has_kv:
                table = seq.block_table
                slot_mapping.extend(kv_slots(table, range(start, end), bs))
            if self.has_window:
                table = seq.window_table
                window_slots.extend(kv_slots(table, range(start, end), bs))
            if start + n == seq.num_tokens:
                if m:  # the last pending token's row and each draft's: m + 1 predictions
                    verify_rows.extend(range(offset + n - 1, offset + n + m))
                    verify_seqs.append(item)
                else:
                    sample_rows.append(offset + n - 1)
                    sample_seqs.append(item)
            if seq.wants_prompt_logprobs:
                last = min(start + n, len(seq.prompt_token_ids) - 1)  # positions predicting a prompt token
                if last > start:
                    prompt_rows.extend(range(offset, offset + last - start))
                    prompt_seqs.append((item, start, last - start))
        groups = self._captured_groups(order, prompt_chunks, prompt_rows)
        if groups is not None:
            hidden = self._replay_groups(groups, order, input_ids, positions, slot_mapping, window_slots)
        else:  # prompt chunks, prompt logprobs, or more sequences than the captures take
            batch = ForwardBatch(
                slot_mapping=self._rows(slot_mapping) if self.has_kv else None,
                decode=self._group(decodes, 0),
                prefill=self._group(prefills, len(decodes), len(generated)),
                caches=self.caches,
                window_slot_mapping=self._rows(window_slots) if self.has_window else None,
            )
            hidden = self.model(_int_tensor(input_ids, self.device), _int_tensor(positions, self.device), batch)
        sample_logits = self._logits_of(hidden, sample_rows)
        verify_logits = self._logits_of(hidden, verify_rows)
        prompt_logits = None
        if prompt_rows:
            prompt_logits = self.model.compute_logits(hidden[_int_tensor(prompt_rows, self.device)])
        return StepLogits(order, sample_seqs, sample_logits, prompt_seqs, prompt_logits, verify_seqs, verify_logits,
                          hidden, starts, offsets)

    def _captured_groups(self, order: list[ScheduledSeq], prompt_chunks: list[ScheduledSeq], prompt_rows: list[int]
                         ) -> list[tuple[CapturedDecode, int, int]] | None:
        """The captures this step replays, one per token count, as (capture, first item, end item) over
        ``order`` (sorted by count): decodes on the decode capture, verifications and reruns of ``q`` tokens on
        that count's; None when any sequence has none (prompt chunks, prompt logprobs, too many sequences)."""
        if prompt_chunks or prompt_rows:
            return None
        groups = []
        start = 0
        while start < len(order):
            q = order[start].num_run
            end = start
            while end < len(order) and order[end].num_run == q:
                end += 1
            captured = self.captured_decode if q == 1 else self.captured_steps.get(q)
            if captured is None or end - start > captured.max_rows:
                return None
            groups.append((captured, start, end))
            start = end
        return groups

    def _replay_groups(self, groups: list[tuple[CapturedDecode, int, int]], order: list[ScheduledSeq],
                       input_ids: list[int], positions: list[int], slot_mapping: list[int],
                       window_slots: list[int]) -> torch.Tensor:
        """Replay each group's capture over its sequences' slice of the step; their hidden states (T, hidden)
        in ``order`` (one view when one capture ran; each capture's output stays valid until it replays again)."""
        outs = []
        token = 0
        for captured, first, end in groups:
            items = order[first:end]
            n = sum(it.num_run for it in items)
            span = slice(token, token + n)
            seqs = [it.seq for it in items]
            outs.append(captured.run(input_ids[span], positions[span], slot_mapping[span] if self.has_kv else [],
                                     [s.num_computed_tokens + it.num_run for s, it in zip(seqs, items)],
                                     [s.block_table for s in seqs] if self.has_kv else [],
                                     _state_slots(items) if self.has_state else [],
                                     (window_slots[span], [s.window_table for s in seqs]) if self.has_window
                                     else None, _keys(seqs) if self.coded_state else None))
            token += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _logits_of(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """Sampling logits of ``rows`` of ``hidden`` (all of them without a gather), or None for no rows."""
        if not rows:
            return None
        if len(rows) == hidden.shape[0]:  # every row (a decode-only step, a single verification): no gather
            return self.model.sampling_logits(hidden)
        return self.model.sampling_logits(hidden[_int_tensor(rows, self.device)])


    @torch.inference_mode()
    def run_one_token_rows(self, seqs: list, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One token per sequence at the given positions, on each sequence's speculative slot (a draft model's
        drafting steps); returns sampling logits (len(seqs), V). The tokens are not the sequences' own: the
        caller keeps track of what the speculative slot has absorbed."""
        bs = self.block_size
        slot_mapping = [kv_slot(s.block_table, p, bs) for s, p in zip(seqs, positions)] if self.has_kv else []
        seq_lens = [p + 1 for p in positions]
        slots = [s.spec_slot for s in seqs]
        window = None
        if self.has_window:
            window = ([kv_slot(s.window_table, p, bs) for s, p in zip(seqs, positions)],
                      [s.window_table for s in seqs])
        captured = self.captured_decode
        if captured is not None and len(seqs) <= captured.max_rows:
            hidden = captured.run(token_ids, positions, slot_mapping, seq_lens,
                                  [s.block_table for s in seqs] if self.has_kv else [], slots if self.has_state else [],
                                  window, _keys(seqs) if self.coded_state else None)
        else:
            n = len(seqs)
            group = SeqGroup(0, n, torch.arange(n + 1, dtype=torch.int64), _int_tensor(seq_lens, self.device),
                             self._tables([s.block_table for s in seqs]) if self.has_kv else None,
                             self._slots(slots) if self.has_state else None,
                             self._tables([s.window_table for s in seqs]) if self.has_window else None,
                             rounding_keys=self._rounding_keys(seqs))
            batch = ForwardBatch(slot_mapping=self._rows(slot_mapping) if self.has_kv else None,
                                 decode=group, prefill=None, caches=self.caches,
                                 window_slot_mapping=self._rows(window[0]) if window else None)
            hidden = self.model(_int_tensor(token_ids, self.device), _int_tensor(positions, self.device), batch)
        return self.model.sampling_logits(hidden)


def _generated(item: ScheduledSeq) -> bool:
    """Whether every token ``item`` runs is a generated one (or a draft): it starts past the prompt."""
    return item.seq.num_computed_tokens >= len(item.seq.prompt_token_ids)


def _keys(seqs: list) -> list[int]:
    """The rounding keys of 8-bit state of sequences: each one's seed (cache/state_codec.py: rounding_key)."""
    return [rounding_key(s.params.seed) for s in seqs]


def _state_slots(items: list[ScheduledSeq]) -> list[int]:
    """Each sequence's state slot this step: a verification runs on its speculative slot (a copy of its
    state: the state slot keeps the state before the drafts, for when one is rejected)."""
    return [it.seq.spec_slot if it.on_spec_slot else it.seq.state_slot for it in items]
