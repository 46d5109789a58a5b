"""The one module that imports `redis`: how a connection is made, and which of its errors mean what.

Everything else of the transport talks to Redis through the client made here and names redis-py's
errors by the names below, so a change of client library is a change of this file.
"""

from __future__ import annotations

import os

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


def client(cfg: RedisConfig, max_connections: int) -> Redis:
    if not cfg.url:
        raise ConfigError("redis.url: not set (`jaxstream up` starts an embedded Redis; a lone service needs redis.url=redis://host:port)")
    pool = aioredis.BlockingConnectionPool.from_url(
        cfg.url,
        password=os.environ.get(REDIS_PASSWORD_ENV) or None,  # a password in the URL wins (redis-py)
        max_connections=max_connections,
        timeout=10,
        protocol=2,  # pin RESP2: RESP3 changes reply shapes
        socket_timeout=cfg.block_ms / 1000 + 5,  # above the longest BLOCK
        socket_connect_timeout=5,
        health_check_interval=0,
    )
    return aioredis.Redis(connection_pool=pool)
