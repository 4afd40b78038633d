"""``--kv-events-config``: the flag's JSON, and the ZMQ publisher's wire format (vLLM's), live and replayed."""

from __future__ import annotations

import importlib.util
import time

import pytest

from hybridserve.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from hybridserve.entrypoints.openai.kv_events import KVEventsConfig, ZmqEventPublisher
from tests.server.server_utils import free_port

needs_zmq = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("zmq", "msgpack")),
                               reason="the publisher needs pyzmq and msgpack (pip install 'hybridserve[kv-events]')")


def test_config_json():
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}')
    assert config.active and config.resolved_publisher == "zmq" and config.endpoint == "tcp://*:6000"
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').active
    assert not KVEventsConfig.from_json("{}").active
    for text, error in [("[1]", "JSON object"), ("{", "not JSON"), ('{"enabled": true}', "unknown key.*enabled"),
                        ('{"publisher": "kafka"}', "publisher"), ('{"hwm": 0}', "hwm"),
                        ('{"enable_kv_cache_events": 1}', "true or false"), ('{"endpoint": 5}', "endpoint")]:
        with pytest.raises(ValueError, match=error):
            KVEventsConfig.from_json(text)


def _recv(sock, timeout: float = 5.0) -> list[bytes]:
    assert sock.poll(int(timeout * 1000)), "nothing received"
    return sock.recv_multipart()


@needs_zmq
def test_batches_go_out_in_vllm_format_and_replay():
    import msgpack
    import zmq

    endpoint, replay_endpoint = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint,
                                                 replay_endpoint=replay_endpoint, topic="kv"))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        time.sleep(0.3)  # a SUB socket misses what is sent before it has joined
        stored = BlockStored((11, 12), None, tuple(range(32)), 16)
        publisher.publish([stored, BlockRemoved((11, 12))])
        publisher.publish([])  # nothing to send: no message
        publisher.publish([AllBlocksCleared()])
        frames = [_recv(sub), _recv(sub)]
        assert [f[0] for f in frames] == [b"kv", b"kv"]
        assert [int.from_bytes(f[1], "big", signed=True) for f in frames] == [0, 1]
        ts, events = msgpack.unpackb(frames[0][2])
        assert abs(ts - time.time()) < 60
        assert events == [{"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
                           "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU",
                           "lora_name": None},
                          {"type": "BlockRemoved", "block_hashes": [11, 12], "medium": "GPU"}]
        assert msgpack.unpackb(frames[1][2])[1] == [{"type": "AllBlocksCleared"}]
        # a subscriber that missed batches asks the replay socket from a sequence number on
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = _recv(dealer)
        assert replayed[0] == b"" and replayed[1] == b"kv" and replayed[2:] == frames[1][1:]
        end = _recv(dealer)
        assert int.from_bytes(end[-2], "big", signed=True) == -1
        dealer.close(0)
    finally:
        sub.close(0)
        ctx.term()
        publisher.close()


@needs_zmq
def test_an_endpoint_in_use_is_a_clear_error():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    first = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint))
    try:
        with pytest.raises(ValueError, match="cannot bind"):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint))
    finally:
        first.close()
