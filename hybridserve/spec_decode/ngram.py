"""Prompt-lookup drafting: propose the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``).

Each sequence keeps an index of where every ``prompt_lookup_min``-gram of its tokens ends, extended as
tokens are appended, so a lookup costs the few candidates of one n-gram rather than a scan of the text.
"""

from __future__ import annotations

#: candidates (latest first) examined per lookup for a longer match
MAX_CANDIDATES = 8


class NgramIndex:
    """The ``n``-grams of one token sequence (n = ``prompt_lookup_min``) and where each ends."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of its last token, ascending
        self.length = 0  # tokens indexed so far

    def extend(self, tokens: list[int]) -> None:
        """Index every n-gram ending in ``tokens[self.length:]`` (``tokens`` only ever grows)."""
        n = self.n
        for end in range(max(self.length, n - 1), len(tokens)):
            self.ends.setdefault(tuple(tokens[end - n + 1:end + 1]), []).append(end)
        self.length = len(tokens)


def propose(tokens: list[int], index: NgramIndex, k: int, lookup_max: int) -> list[int]:
    """Up to ``k`` tokens following the latest earlier occurrence of ``tokens``' longest suffix of
    ``index.n`` to ``lookup_max`` tokens that occurred before; [] when even the shortest has not."""
    index.extend(tokens)
    n, last = index.n, len(tokens) - 1
    if last < n or k < 1:
        return []
    ends = index.ends.get(tuple(tokens[last - n + 1:]))
    if not ends or len(ends) < 2:
        return []  # only the suffix itself
    best_end, best_len = -1, 0
    for end in reversed(ends[-MAX_CANDIDATES - 1:-1]):  # earlier occurrences, latest first
        length = n
        while length < lookup_max and end - length >= 0 and tokens[end - length] == tokens[last - length]:
            length += 1
        if length > best_len:
            best_end, best_len = end, length
            if length == lookup_max:
                break
    return tokens[best_end + 1:best_end + 1 + k]
