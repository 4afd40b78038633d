"""``--kv-events-config``: publish the prefix cache's block events over ZMQ, as vLLM does, for a KV-aware router.

The flag takes vLLM's JSON (``KVEventsConfig``'s keys)::

    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"}'

Wire format (vLLM's ZMQ publisher): a PUB socket bound at ``endpoint`` sends one multipart message per batch,
``[topic, seq, payload]``: ``seq`` an 8-byte big-endian signed counter from 0, ``payload`` the msgpack of
``[ts, events]`` (``ts`` seconds since the epoch, a float). Each event is a map tagged by its ``type``:
``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None, "token_ids": [...],
"block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}``, ``{"type": "BlockRemoved",
"block_hashes": [...], "medium": "GPU"}``, ``{"type": "AllBlocksCleared"}``. ``medium`` is vLLM's name for the
tier that holds the blocks (the engine's own pool: ``GPU`` in vLLM's terms, whatever the device).

With ``replay_endpoint``, a ROUTER socket bound there answers ``[b"", start_seq]`` (8 bytes, big-endian) with
every buffered batch from ``start_seq`` on, each ``[b"", topic, seq, payload]``, then ``[b"", topic, -1, b""]``
(the last ``buffer_steps`` batches are kept), so a subscriber that missed some catches up.

Exposure. The sockets have no authentication, and every ``BlockStored`` event carries the token ids of an
unsalted prompt's blocks (salted requests' blocks are not published). So the default endpoint is on loopback
(``tcp://127.0.0.1:5557``, where vLLM binds every interface), and an endpoint or replay endpoint that is not on
loopback (``tcp://*:...``, an interface, another address or transport) is refused unless the server is started
with ``--kv-events-allow-remote``; then it is logged at WARNING (:func:`check_exposure`).

The events themselves (what a block is, its hash, why a hybrid publishes KV blocks): :mod:`hybridserve.cache.kv_events`.
Needs ``pyzmq`` and ``msgpack`` (``pip install 'hybridserve[kv-events]'``). Docs: ``docs/data_parallel.md``.
"""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from hybridserve.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)

#: vLLM's name for the tier of the blocks an engine holds in its own cache pool
MEDIUM = "GPU"
#: the ``seq`` frame that ends a replay
END_SEQ = -1


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig``: whether and where to publish."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled
    endpoint: str = "tcp://127.0.0.1:5557"  # loopback (vLLM's default is every interface: see check_exposure)
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread, at most (past it: dropped, counted)
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        """Parse the flag's JSON; ValueError naming a bad key or value."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown key(s) {', '.join(unknown)}; the keys are "
                             f"{', '.join(fields)}")
        config = cls(**data)
        config.validate()
        return config

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.resolved_publisher == "zmq"

    @property
    def resolved_publisher(self) -> str:
        return self.publisher if self.publisher is not None else ("zmq" if self.enable_kv_cache_events else "null")

    def validate(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("--kv-events-config: enable_kv_cache_events must be true or false")
        if self.resolved_publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher {self.publisher!r} is not one of zmq, null")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"--kv-events-config: {name} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError("--kv-events-config: replay_endpoint must be a string or null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--kv-events-config: {name} must be an integer >= 1, not {value!r}")


def is_loopback_endpoint(endpoint: str) -> bool:
    """Whether a ZMQ endpoint is reachable from this machine only: ``tcp://`` on a loopback address or
    ``localhost``, ``ipc://`` or ``inproc://``."""
    transport, sep, address = endpoint.partition("://")
    if not sep:
        return False
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp":
        return False
    host = address.rsplit(":", 1)[0]
    if ";" in host:  # tcp://SOURCE;DEST: a connect form, never a bind on loopback alone
        return False
    host = host.removeprefix("[").removesuffix("]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a host name


def check_exposure(config: KVEventsConfig, allow_remote: bool) -> list[str]:
    """The endpoints of an active ``config`` that are not on loopback. ValueError if there are any and
    ``allow_remote`` is off; logged at WARNING (what they expose) if it is on."""
    if not config.active:
        return []
    exposed = [e for e in (config.endpoint, config.replay_endpoint) if e is not None and not is_loopback_endpoint(e)]
    if not exposed:
        return exposed
    what = ("every unsalted prompt's token ids, to anyone who connects, without authentication" +
            (" (the replay endpoint serves the last %d batches)" % config.buffer_steps
             if config.replay_endpoint in exposed else ""))
    if not allow_remote:
        raise ValueError(f"--kv-events-config: {', '.join(exposed)} is not a loopback endpoint; the KV events expose "
                         f"{what}. Bind tcp://127.0.0.1:PORT, or pass --kv-events-allow-remote to publish beyond "
                         "this machine")
    logger.warning("KV cache events are published on %s beyond loopback (--kv-events-allow-remote): they expose %s",
                   ", ".join(exposed), what)
    return exposed


def event_wire(event: KVEvent) -> dict[str, Any]:
    """An event as the map vLLM's publisher sends (tagged by ``type``)."""
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                "block_size": event.block_size, "lora_id": None, "medium": MEDIUM, "lora_name": None}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": MEDIUM}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(ts: float, events: list[KVEvent]) -> bytes:
    """The msgpack payload of one batch: ``[ts, [event, ...]]``."""
    import msgpack

    return msgpack.packb([ts, [event_wire(e) for e in events]], use_bin_type=True)


def _seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    """Sends event batches from a thread of its own (it owns the sockets); :meth:`publish` never blocks.

    An endpoint beyond loopback needs ``allow_remote`` (ValueError otherwise; see :func:`check_exposure`)."""

    def __init__(self, config: KVEventsConfig, allow_remote: bool = False) -> None:
        check_exposure(config, allow_remote)
        try:
            import msgpack  # noqa: F401
            import zmq  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"--kv-events-config needs pyzmq and msgpack ({exc.name} is missing): "
                             "pip install 'hybridserve[kv-events]'") from None
        self.config = config
        self.num_dropped = 0  # batches dropped because the queue was full
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hybridserve-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise ValueError(f"--kv-events-config: cannot bind {self._error}") from None

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one batch (from the engine thread); dropped, and counted, when the queue is full."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), list(events)))
        except queue.Full:
            if self.num_dropped == 0:
                logger.warning("KV event queue full (%d batches): dropping batches", self.config.max_queue_size)
            self.num_dropped += 1

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    # ----------------------------------------------------------- its thread
    def _run(self) -> None:
        import zmq

        config = self.config
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, config.hwm)
        pub.setsockopt(zmq.LINGER, 1000)
        replay = ctx.socket(zmq.ROUTER) if config.replay_endpoint is not None else None
        endpoint = config.endpoint
        try:
            pub.bind(endpoint)
            if replay is not None and config.replay_endpoint is not None:
                replay.setsockopt(zmq.LINGER, 0)
                endpoint = config.replay_endpoint
                replay.bind(endpoint)
        except zmq.ZMQError as exc:
            self._error = RuntimeError(f"{endpoint}: {exc}")
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(0)
            ctx.term()
            self._ready.set()
            return
        self._ready.set()
        topic = config.topic.encode()
        buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        seq = 0
        try:
            while True:
                if replay is not None:
                    self._serve_replays(replay, topic, buffer)
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is None:
                    return
                ts, events = item
                payload = encode_batch(ts, events)
                pub.send_multipart([topic, _seq_bytes(seq), payload])
                buffer.append((seq, payload))
                seq += 1
        except Exception:  # noqa: BLE001 - the publisher stops; serving goes on
            logger.exception("the KV event publisher failed; no more events are published")
        finally:
            pub.close()
            if replay is not None:
                replay.close()
            ctx.term()

    @staticmethod
    def _serve_replays(replay, topic: bytes, buffer) -> None:
        import zmq

        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, start_frame = frames[0], frames[-1]
            start = int.from_bytes(start_frame[:8], "big", signed=True) if len(start_frame) >= 8 else 0
            for seq, payload in list(buffer):
                if seq >= start:
                    replay.send_multipart([identity, b"", topic, _seq_bytes(seq), payload])
            replay.send_multipart([identity, b"", topic, _seq_bytes(END_SEQ), b""])
