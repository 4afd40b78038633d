"""Drafting with the checkpoint's multi-token-prediction head (``models/mtp.py``).

The head's attention KV lives in the target's pool (layers after the target's). After every target
forward, the head runs over the rows whose next token is known now (prefill chunks, decodes, a
verification's accepted positions): row ``p`` takes the target's hidden state at ``p`` and the token at
``p + 1``, writes its KV at ``p``, and the last row of a sequence that decodes next predicts the token after
its pending one, the first draft. ``k - 1`` one-token steps of the head on its own hidden states give the
others (their KV, at positions the target has not reached, is written again once it has). The head keeps no
recurrent state: a rejected draft needs nothing rolled back on its side.
"""

from __future__ import annotations

import logging

import torch

from hybridserve.cache.layout import kv_slots
from hybridserve.cache.manager import CacheManager
from hybridserve.engine.model_runner import table_tensor
from hybridserve.forward_batch import ForwardBatch, SeqGroup
from hybridserve.models.mtp import MTPHead
from hybridserve.spec_decode.acceptance import draw_drafts

logger = logging.getLogger(__name__)


def _ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class MTPDrafter:
    """Runs an :class:`~hybridserve.models.mtp.MTPHead` after each step; drafts wait on each sequence."""

    def __init__(self, head: MTPHead, cache: CacheManager, k: int) -> None:
        self.head = head
        self.cache = cache
        self.pool = cache.pool
        self.k = k
        self.block_size = self.pool.layout.block_size

    def _slots(self, seq, positions: range | list[int]) -> list[int]:
        return kv_slots(seq.block_table, positions, self.block_size)

    @torch.inference_mode()
    def after_step(self, logits, room_of, default_generator: torch.Generator) -> None:
        """Run the head over the step's rows whose next token is known; draft for the sequences that decode
        next (``room_of(seq)`` drafts at most, 0: none), leaving them on ``seq.spec``."""
        rows: list[int] = []
        positions: list[int] = []
        ids, slots, cu, seq_lens, seqs = [], [], [0], [], []
        for item, start, offset in zip(logits.order, logits.starts, logits.offsets):
            seq = item.seq
            if seq.is_finished or logits.hidden is None:
                continue
            valid = item.num_tokens + (item.num_accepted if item.drafts else 0)
            valid = min(valid, seq.num_tokens - 1 - start)  # rows whose next token exists
            if valid <= 0:
                continue
            rows.extend(range(offset, offset + valid))
            ids.extend(seq.token_ids_slice(start + 1, valid))
            positions.extend(range(start, start + valid))
            slots.extend(self._slots(seq, range(start, start + valid)))
            cu.append(cu[-1] + valid)
            seq_lens.append(start + valid)
            seqs.append(seq)
        if not seqs:
            return
        hidden = logits.hidden[_ints(rows)]  # (R, hidden)
        out = self.head(_ints(ids), _ints(positions), hidden, self._batch(seqs, slots, cu, seq_lens), step=0)
        drafting = []  # (index into seqs, room)
        for i, seq in enumerate(seqs):
            # it drafts when its last row is the one before its pending token
            seq_room = room_of(seq) if seq_lens[i] == seq.num_tokens - 1 else 0
            if seq.spec is not None:
                seq.spec.mtp_drafts, seq.spec.mtp_probs, seq.spec.mtp_base = [], [], seq.num_tokens
            if seq_room > 0 and seq.spec is not None:
                drafting.append((i, seq_room))
        if not drafting:
            return
        last = [cu[i + 1] - 1 for i, _ in drafting]
        current = out[_ints(last)]  # (D, hidden)
        active = drafting
        for step in range(max(room for _, room in drafting)):
            drafters = [seqs[i] for i, _ in active]
            tokens, dists = draw_drafts(self.head.compute_logits(current), drafters, default_generator)
            for r, p in sorted(dists.items()):
                drafters[r].spec.mtp_probs.append(p)
            for (i, _), token in zip(active, tokens):
                seqs[i].spec.mtp_drafts.append(token)
            keep = [r for r, (_, room) in enumerate(active) if room > step + 1]
            if not keep:
                break
            active, current, tokens = [active[r] for r in keep], current[_ints(keep)], [tokens[r] for r in keep]
            # the next draft: the head on its own hidden state and the draft just made, at the next position
            step_seqs = [seqs[i] for i, _ in active]
            pos = [s.num_tokens - 1 + step for s in step_seqs]  # the position before the new draft's
            ok = [r for r, s in enumerate(step_seqs) if self.cache.grant(s, pos[r] + 1 - s.num_computed_tokens)]
            if len(ok) != len(step_seqs):  # no page for the head's KV there: those stop drafting
                active, current = [active[r] for r in ok], current[_ints(ok)]
                tokens, step_seqs, pos = [tokens[r] for r in ok], [step_seqs[r] for r in ok], [pos[r] for r in ok]
                if not active:
                    break
            slots = [self._slots(s, [p])[0] for s, p in zip(step_seqs, pos)]
            batch = self._batch(step_seqs, slots, list(range(len(step_seqs) + 1)), [p + 1 for p in pos], decode=True)
            current = self.head(_ints(tokens), _ints(pos), current, batch, step=step + 1)

    def _batch(self, seqs: list, slots: list[int], cu: list[int], seq_lens: list[int],
               decode: bool = False) -> ForwardBatch:
        pages = self.pool.pages  # handles -> positions in the pool's views
        tables = pages.positions(table_tensor([s.block_table for s in seqs], torch.device("cpu")))  # (S, width)
        group = SeqGroup(0, cu[-1], _ints(cu), _ints(seq_lens), tables, None)
        return ForwardBatch(slot_mapping=pages.kv_rows(_ints(slots), self.block_size), decode=group if decode else None,
                            prefill=None if decode else group, caches=self.pool.layer_caches)
