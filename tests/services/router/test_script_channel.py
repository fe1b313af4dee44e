"""The routing path's connection: sends do not wait, calls see them, and failures heal."""

from __future__ import annotations

import pytest
import redis
from baton.services.router.script_channel import ScriptChannel

INCR = "return redis.call('INCRBY', ARGV[1], ARGV[2])"
GET = "return redis.call('GET', ARGV[1])"
FAIL = "return redis.error_reply('boom')"


def test_a_call_sees_every_earlier_send(redis_server):
    channel = ScriptChannel(redis_server.client(), [INCR, GET, FAIL])
    for _ in range(100):  # more than the unread limit: sends drain on their own
        channel.send(INCR, ["n", 1])
    assert channel.call(GET, ["n"]) == b"100"
    channel.send(INCR, ["n", 5])
    channel.flush()
    assert redis_server.client().get("n") == b"105"


def test_a_failed_send_is_counted_and_the_connection_stays_in_step(redis_server):
    channel = ScriptChannel(redis_server.client(), [INCR, GET, FAIL])
    channel.send(FAIL, [])
    channel.send(INCR, ["n", 2])
    assert channel.call(GET, ["n"]) == b"2"
    assert channel.num_send_errors == 1
    with pytest.raises(redis.ResponseError, match="boom"):
        channel.call(FAIL, [])
    assert channel.call(GET, ["n"]) == b"2"


def test_scripts_are_reloaded_when_the_connection_reopens(own_redis):
    channel = ScriptChannel(redis.Redis.from_url(own_redis.url), [INCR, GET])
    channel.send(INCR, ["n", 1])
    own_redis.kill()
    with pytest.raises(redis.ConnectionError):
        channel.call(GET, ["n"])
    own_redis.start()  # empty, and without the scripts
    assert channel.call(INCR, ["n", 3]) == 3
