"""Sequence bookkeeping helpers."""

from __future__ import annotations

from hybridserve.engine.sequence import Sequence
from hybridserve.sampling_params import SamplingParams


def test_token_ids_slice_equals_slicing_all_token_ids():
    seq = Sequence("r", [10, 11, 12, 13], SamplingParams(), arrival=0)
    seq.output_token_ids = [20, 21, 22]
    every = seq.all_token_ids
    for start in range(len(every) + 1):
        for count in range(len(every) - start + 2):
            assert seq.token_ids_slice(start, count) == every[start:start + count], (start, count)
