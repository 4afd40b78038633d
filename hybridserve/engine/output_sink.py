"""Where one caller's outputs arrive from the engine thread (:mod:`hybridserve.engine.async_engine`).

Outputs are cumulative (each holds the whole text so far), so a sink keeps only the latest one per
request: a slow reader costs no memory however far behind it falls.
"""

from __future__ import annotations

import asyncio

from hybridserve.outputs import RequestOutput


class OutputSink:
    """Where one caller's outputs arrive: the latest output per request id, and a wake-up event.

    One sink may collect several engine requests (a completion with several prompts). Only the
    asyncio loop thread touches it.
    """

    def __init__(self) -> None:
        self._latest: dict[str, RequestOutput] = {}
        self._event = asyncio.Event()
        self._error: BaseException | None = None

    def put(self, output: RequestOutput) -> None:
        self._latest[output.request_id] = output
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    async def get(self, timeout: float | None = None) -> dict[str, RequestOutput]:
        """Wait for new outputs (at most ``timeout`` seconds; then ``{}``) and take them, by request id."""
        if not self._event.is_set():
            try:
                await asyncio.wait_for(self._event.wait(), timeout)
            except asyncio.TimeoutError:
                return {}
        self._event.clear()
        if self._error is not None:
            raise self._error
        taken, self._latest = self._latest, {}
        return taken
