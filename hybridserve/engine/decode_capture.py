"""Decode steps replayed from captures of the model's own forward, one per batch-size bucket.

At engine start the model's eager forward runs once per bucket (1, 2, 4, ... up to
``max_num_seqs`` sequences of one token each) over static input buffers (token ids, positions,
state slots, block tables, context lengths, KV write slots) and is recorded as a kernel graph
(``kernels/graph.py``). A decode step of ``n`` sequences then fills the buffers' first ``n`` rows,
marks the rest of its bucket as padding, and replays the bucket's graph: the kernel calls the eager
forward makes, without the Python between them.

A padding row holds nothing of the pool, so capture costs no sequence of capacity: its state slot is
-1 and its KV write slots are -1 (the kernels read and write no state and no page for it), and its
context length is 0 (attention reads no page for it); the kernels give it zero outputs, which the
step drops. A model whose forward
runs anything but kernels is not captured; the reason names the operators, and it runs eagerly.

:meth:`CapturedDecode.run` takes page and slot handles (what sequences hold) and writes positions into the
buffers, through the pool's handle maps (:mod:`hybridserve.cache.handle_map`): the write rows and state
slots every step (a numpy gather), a block table when it changed or when the pool's ``epoch`` says a
compaction moved something since it was written.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from hybridserve.cache.pool import CachePool
from hybridserve.forward_batch import ForwardBatch, SeqGroup
from hybridserve.kernels.graph import CaptureError, Graph, capture, module_regions, tensor_region

logger = logging.getLogger(__name__)

#: a padding row's state slot and KV write slots: none (the kernels skip negative slots)
PADDING_SLOT = -1
#: a padding row's context length: empty (attention reads no page for it)
PADDING_CONTEXT = 0


def bucket_sizes(max_rows: int) -> list[int]:
    """Powers of two below ``max_rows``, then ``max_rows``."""
    sizes = []
    n = 1
    while n < max_rows:
        sizes.append(n)
        n *= 2
    return sizes + [max_rows]


class CapturedDecode:
    """The captured step graphs of one model and pool for one token count per sequence; :meth:`run`
    replays one step.

    ``tokens_per_row`` 1 (a decode step) records the forward's decode group; more (a speculative
    verification: the pending token and its drafts, or the replay after a rejected draft) record a
    group of that many tokens per sequence, run by the same kernels as a prefill chunk.
    """

    def __init__(self, model: torch.nn.Module, pool: CachePool, max_rows: int, max_model_len: int,
                 tokens_per_row: int = 1, caches: dict | None = None) -> None:
        self.model = model
        self.caches = pool.layer_caches if caches is None else caches  # what the model's cache indices address
        self.max_rows = max_rows
        self.q = q = tokens_per_row
        self.block_size = pool.layout.block_size
        if q > self.block_size:
            raise ValueError(f"a captured step takes at most block_size={self.block_size} tokens per sequence, got {q}")
        self.has_kv, self.has_state = pool.layout.has_kv, pool.layout.has_state
        width = -(-(max_model_len + q) // self.block_size) if self.has_kv else 1
        i64 = dict(dtype=torch.int64)
        self.input_ids = torch.zeros(max_rows * q, **i64)  # (rows * q,)
        self.positions = torch.arange(max_rows * q, **i64) % q
        self.cu_seqlens = torch.arange(max_rows + 1, **i64) * q  # q tokens per sequence
        # every row starts as padding: no context, no KV write slot, no state slot
        self.seq_lens = torch.full((max_rows,), PADDING_CONTEXT, **i64)  # context length after the step
        self.block_tables = torch.zeros(max_rows, width, **i64)  # (rows, width): a padding row's is never read
        self.state_indices = torch.full((max_rows,), PADDING_SLOT, **i64)
        self.slot_mapping = torch.full((max_rows * q,), PADDING_SLOT, **i64)  # (rows * q,)
        self.rounding_keys = torch.zeros(max_rows, **i64)  # 8-bit state's rounding keys (padded rows: 0)
        self.has_window = pool.layout.has_window  # the window page group's tables and write slots too
        self.window_block_tables = torch.zeros(max_rows, width if self.has_window else 1, **i64)
        self.window_slot_mapping = self.slot_mapping.clone()
        self._inputs = (self.input_ids, self.positions, self.cu_seqlens, self.seq_lens, self.block_tables,
                        self.state_indices, self.slot_mapping, self.window_block_tables, self.window_slot_mapping,
                        self.rounding_keys)
        # numpy views of the same memory: filling them from Python lists is cheaper than torch ops
        self._np = {name: getattr(self, name).numpy() for name in
                    ("input_ids", "positions", "seq_lens", "block_tables", "state_indices", "slot_mapping",
                     "window_block_tables", "window_slot_mapping", "rounding_keys")}
        self._tables_written: list[list[int] | None] = [None] * max_rows  # each row's block table as written
        self._window_written: list[list[int] | None] = [None] * max_rows  # each row's window table as written
        self._epoch = pool.epoch  # the pool's epoch the written tables were translated at
        self._pool = pool
        self.graphs: dict[int, Graph] = {}
        self.arena: torch.Tensor | None = None

    def _batch(self, rows: int) -> ForwardBatch:
        t = rows * self.q
        group = SeqGroup(0, t, self.cu_seqlens[:rows + 1], self.seq_lens[:rows],
                         self.block_tables[:rows] if self.has_kv else None,
                         self.state_indices[:rows] if self.has_state else None,
                         self.window_block_tables[:rows] if self.has_window else None,
                         num_generated=rows,  # a step of several tokens each replays generated ones only
                         rounding_keys=self.rounding_keys[:rows] if self.has_state else None)
        one_token = self.q == 1
        return ForwardBatch(slot_mapping=self.slot_mapping[:t] if self.has_kv else None,
                            decode=group if one_token else None, prefill=None if one_token else group,
                            caches=self.caches,
                            window_slot_mapping=self.window_slot_mapping[:t] if self.has_window else None)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket (raises :class:`CaptureError` with the reason when the model cannot be)."""
        fixed = [tensor_region(t) for t in self._inputs] + [tensor_region(self._pool.buffer)]
        for rows in bucket_sizes(self.max_rows):
            def forward(rows=rows):
                t = rows * self.q
                return self.model(self.input_ids[:t], self.positions[:t], self._batch(rows))

            forward()  # eagerly first: a layer's lazily derived parameters exist before the capture
            # the model's regions after the eager run, which may have derived parameters
            self.graphs[rows] = capture(forward, module_regions(self.model) + fixed)
        self.arena = torch.empty(max(g.arena_bytes for g in self.graphs.values()), dtype=torch.uint8)
        for graph in self.graphs.values():
            graph.place(self.arena)
        largest = self.graphs[self.max_rows]
        logger.info("%s captured for %d bucket sizes up to %d sequences: %d kernel calls a step, %.1f MiB of "
                    "temporaries", "decode" if self.q == 1 else f"{self.q}-token step", len(self.graphs),
                    self.max_rows, largest.num_calls, self.arena.numel() / 2**20)

    def bucket(self, rows: int) -> int | None:
        """The bucket a step of ``rows`` sequences replays, or None when it is larger than any."""
        return next((b for b in self.graphs if b >= rows), None)

    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int], seq_lens: list[int],
            block_tables: list[list[int]], state_slots: list[int],
            window: tuple[list[int], list[list[int]]] | None = None,
            rounding_keys: list[int] | None = None) -> torch.Tensor:
        """One step of ``len(seq_lens)`` sequences of ``q`` tokens each (token lists: ``q`` entries per
        sequence, in order); returns their final hidden states (rows * q, hidden), a view of the graph's
        output (overwritten by the next step). ``window``: the window page group's (write slots, tables),
        with one. ``rounding_keys``: the sequences' keys of 8-bit state (None: all 0); with ``seq_lens``, an
        input of the step like the others, never a constant of the capture."""
        q = self.q
        rows = len(input_ids) // q
        size = self.bucket(rows)
        if size is None or rows * q != len(input_ids):
            raise ValueError(f"a captured step takes 1 to {self.max_rows} sequences, got {len(input_ids) / q:g} "
                             f"({q} tokens each)")
        np_ = self._np
        pool = self._pool
        if pool.epoch != self._epoch:  # a compaction moved pages since the tables were written: translate again
            self._tables_written = [None] * self.max_rows
            self._window_written = [None] * self.max_rows
            self._epoch = pool.epoch
        t, pad_t = rows * q, size * q
        padded = size > rows
        np_["input_ids"][:t] = input_ids
        np_["positions"][:t] = positions
        if padded:
            np_["input_ids"][t:pad_t] = 0
            np_["positions"][t:pad_t] = np.tile(np.arange(q), size - rows)
        if self.has_kv or self.has_state:  # attention's context lengths; the state's tokens absorbed
            np_["seq_lens"][:rows] = seq_lens
            np_["seq_lens"][rows:size] = PADDING_CONTEXT
        if self.has_kv:
            np_["slot_mapping"][:t] = pool.pages.kv_rows_np(slot_mapping, self.block_size)
            np_["slot_mapping"][t:pad_t] = PADDING_SLOT
            self._write_block_tables(block_tables)
        if self.has_window:
            window_slots, window_tables = window
            np_["window_slot_mapping"][:t] = pool.pages.kv_rows_np(window_slots, self.block_size)
            np_["window_slot_mapping"][t:pad_t] = PADDING_SLOT
            self._write_block_tables(window_tables, "window_block_tables", self._window_written)
        if self.has_state:
            np_["state_indices"][:rows] = pool.slots.positions_np(state_slots)
            np_["state_indices"][rows:size] = PADDING_SLOT
            np_["rounding_keys"][:rows] = 0 if rounding_keys is None else rounding_keys
            np_["rounding_keys"][rows:size] = 0
        return self.graphs[size].replay()[:t]

    def _write_block_tables(self, block_tables: list[list[int]], name: str = "block_tables",
                            written: list[list[int] | None] | None = None) -> None:
        """The first rows get the page positions of their sequences' tables of handles (only those that
        changed since written: a table grows a page every block_size tokens); a padding row's table is never
        read (its context is empty). Entries past a table's length are never read (the kernels stop at the
        context length), nor are a window table's released ones (-1, written as page position 0)."""
        tables, written = self._np[name], self._tables_written if written is None else written
        pages = self._pool.pages
        for r, table in enumerate(block_tables):
            if written[r] != table:
                if table and table[0] < 0:  # released entries are a table's first ones
                    handles = np.asarray(table, dtype=np.int64)
                    released = handles < 0
                    row = np.asarray(pages.positions_np(np.where(released, 0, handles)))
                    row[released] = 0
                    tables[r, :len(table)] = row
                else:
                    tables[r, :len(table)] = pages.positions_np(table)
                written[r] = list(table)


def try_capture(model: torch.nn.Module, pool: CachePool, max_rows: int, max_model_len: int,
                tokens_per_row: int = 1, caches: dict | None = None) -> tuple[CapturedDecode | None, str | None]:
    """The model's captured steps of ``tokens_per_row`` tokens per sequence (1: decode) and None, or None
    and the reason it cannot be captured."""
    captured = CapturedDecode(model, pool, max_rows, max_model_len, tokens_per_row, caches)
    try:
        captured.capture_all()
    except CaptureError as exc:
        return None, str(exc)
    except (RuntimeError, ValueError) as exc:  # a kernel rejected the capture run's arguments
        logger.exception("decode capture failed")
        return None, f"the capture run failed: {exc}"
    return captured, None
