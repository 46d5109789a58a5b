"""The one module that imports `redis`: how a connection is made, and which of its errors mean what.

Everything else of the transport talks to Redis through the clients made here and names redis-py's
errors by the names below, so a change of client library is a change of this file.

Two kinds of connection, by what a lost reply would cost:

- `waits=True`: a service loop's blocking reads and its publishes. No socket timeout: a healthy
  blocking read returns within redis.block_ms, so a read that waits longer is a process that could
  not run (SIGSTOP, a VM or container pause, CPU throttling, swapping) or a dead connection. A
  client-side timer cannot tell them apart, and after a stall it fires together with the reply
  that arrived meanwhile: redis-py then drops the connection with the reply in its buffer, and
  the entries Redis handed over wait in the consumer's pending list, or a publish is sent again
  and lands twice. Without the timer the stalled process reads the reply when it resumes. A dead
  connection is found by other means: a Redis that exits closes it (an error at once), a host
  that vanishes is found by TCP keepalive and TCP_USER_TIMEOUT (the kernel's, which keep running
  while the process is stopped) within KEEPALIVE's bound. Whatever is lost to a connection error
  after Redis delivered it, a consumer reads again from its pending list (consumer.py).
- `waits=False` (the default): what must answer in bounded time (a health probe, an HTTP
  handler's publish, heartbeats, shared state): a socket timeout of redis.block_ms + 5 s.
  These commands are idempotent or answered to a client that is told of the failure; none is
  retried behind its caller's back after its reply was lost.
"""

from __future__ import annotations

import os
import socket

from redis import asyncio as aioredis
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from jaxstream.config import ConfigError, RedisConfig
from jaxstream.keys import REDIS_PASSWORD_ENV

Redis = aioredis.Redis
# Redis unreachable, for now: wait and retry. Any other error is a bug or a refusal.
TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)
# A command Redis refused: NOGROUP, BUSYGROUP, "no such key", WRONGTYPE...
Refused = ResponseError
# The password is wrong or missing: no retry brings it.
Unauthorized = AuthenticationError

# A connection that carries nothing for 5 s is probed every 2 s, 3 times; data unacknowledged for
# 15 s fails it: a vanished Redis host is an error within about 15 s. Options a platform lacks
# are left out (it keeps its own keepalive defaults).
KEEPALIVE = {name: value for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3),
                                             ("TCP_USER_TIMEOUT", 15_000)) if hasattr(socket, name)}
KEEPALIVE_OPTIONS = {getattr(socket, name): value for name, value in KEEPALIVE.items()}


def client(cfg: RedisConfig, max_connections: int, waits: bool = False, name: str | None = None) -> Redis:
    """A client of `max_connections` connections; `waits`: one whose commands may wait as long as
    Redis takes (blocking reads, a service loop's publishes), else one with a socket timeout.
    `name`: its connections' name in Redis's CLIENT LIST (the service instance's)."""
    if not cfg.url:
        raise ConfigError("redis.url: not set (`jaxstream up` starts an embedded Redis; a lone service needs redis.url=redis://host:port)")
    pool = aioredis.BlockingConnectionPool.from_url(
        cfg.url,
        password=os.environ.get(REDIS_PASSWORD_ENV) or None,  # a password in the URL wins (redis-py)
        max_connections=max_connections,
        timeout=10,
        protocol=2,  # pin RESP2: RESP3 changes reply shapes
        socket_timeout=None if waits else cfg.block_ms / 1000 + 5,
        socket_connect_timeout=5,
        socket_keepalive=True,
        socket_keepalive_options=KEEPALIVE_OPTIONS,
        health_check_interval=0,
        client_name=name,
    )
    return aioredis.Redis(connection_pool=pool)
