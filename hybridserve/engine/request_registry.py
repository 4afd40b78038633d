"""Every request's sequences, in one place: what aborts, outputs and "is it done?" look up."""

from __future__ import annotations

from hybridserve.engine.sequence import Sequence


class RequestGroup:
    """The sequences of one request (by completion index) and how many of them have finished."""

    __slots__ = ("seqs", "num_finished", "error")

    def __init__(self, seqs: list[Sequence]) -> None:
        self.seqs = seqs
        self.num_finished = sum(seq.is_finished for seq in seqs)
        self.error: str | None = None  # why the request failed, if it did (for the log, not the client)

    @property
    def finished(self) -> bool:
        """All ``n`` completions exist (or the request failed) and have finished (O(1): counted as they finish)."""
        complete = self.error is not None or len(self.seqs) == self.seqs[0].params.n
        return complete and self.num_finished == len(self.seqs)


class RequestRegistry:
    """Request id -> :class:`RequestGroup`. A sequence is registered before it can hold any cache, so
    an abort always finds every sequence of its request."""

    def __init__(self) -> None:
        self._groups: dict[str, RequestGroup] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, seq: Sequence) -> None:
        self._groups[seq.request_id] = RequestGroup([seq])

    def extend(self, request_id: str, children: list[Sequence]) -> None:
        self._groups[request_id].seqs.extend(children)

    def group(self, request_id: str) -> RequestGroup | None:
        return self._groups.get(request_id)

    def seqs(self, request_id: str) -> list[Sequence]:
        group = self._groups.get(request_id)
        return group.seqs if group is not None else []

    def count_finished(self, seq: Sequence) -> None:
        """Call once when ``seq`` finishes."""
        group = self._groups.get(seq.request_id)
        if group is not None:
            group.num_finished += 1

    def pop(self, request_id: str) -> RequestGroup | None:
        return self._groups.pop(request_id, None)

    def ids(self) -> list[str]:
        return list(self._groups)
