"""gateway: HTTP in, replies out. Never touches a tokenizer or JAX.

1. Each HTTP request gets a request id and a reply queue; its body is validated into a
   GenerateRequest (one per sample and per prompt) and published to the tokenizer stream, naming
   the data-parallel replica that will run it: the one where this gateway has the fewest requests
   in flight (replicas.py), which the tokenizer passes it on to.
2. One loop reads this gateway's own reply stream (outputs from the detokenizer, rejections from the
   tokenizer or scheduler) and routes each item to its request's queue.
3. The route shapes the outputs as OpenAI or SGLang responses, streamed (SSE) or whole.
4. A client that leaves early (stream closed, connection dropped) aborts its request, on its
   replica's scheduler stream; /abort_request's abort_all goes to every replica.
5. A watchdog fails the requests in flight when a service holding their state stops (watchdog.py):
   a replica's scheduler or worker takes only that replica's requests, and new ones go elsewhere.
6. Every route is in a key class (auth.py): generation routes want the user key, what changes
   state or shows configuration the admin key, health and metrics none, when keys are set.
7. Operations routes add up the replicas' heartbeat stats: /v1/loads and /get_server_info list
   each replica's, /metrics labels the families read from each scheduler with `replica`.
8. On SIGTERM (or Ctrl-C) it drains: new generations get a 503 with Retry-After and /health says
   "draining", while those in flight finish, for server.drain_timeout_s at most (a second signal
   ends the wait). Then every request still open ends with an error (a stream: an error event, then
   [DONE]), never a cut connection; its scheduler aborts it once this gateway's heartbeat is gone.
"""

from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

from gateway.app import build_app
from gateway.auth import describe
from gateway.generation import Pipeline
from gateway.http import QuietDisconnects, protocol_with
from gateway.metrics import Metrics
from gateway.replicas import Replicas
from gateway.replies import ReplyRouter
from gateway.watchdog import Watchdog
from jaxstream import protocol
from jaxstream.config import AppConfig
from jaxstream.keys import load_keys
from jaxstream.listen import listen
from jaxstream.service import run
from jaxstream.transport import Bus

log = logging.getLogger("gateway")


async def main(cfg: AppConfig, bus: Bus) -> None:
    keys = load_keys(cfg.server)  # an unreadable key file is a ConfigError, before the port is taken
    sock = listen(cfg.server.host, cfg.server.port)  # first: a busy port is a ConfigError, said in one line
    log.info("keys: %s", describe(keys))
    logging.getLogger("asyncio").addFilter(QuietDisconnects())
    router = ReplyRouter(bus)
    inbox = bus.consumer([router.stream], protocol.decoder(protocol.GatewayInput))
    await inbox.ensure_groups(from_start=False)
    replies = asyncio.create_task(router.run(inbox), name="replies")
    replicas = Replicas(cfg.parallelism.data)
    watchdog = Watchdog(bus, router, replicas)
    watching = asyncio.create_task(watchdog.run(), name="watchdog")
    pipeline = Pipeline(bus, router, watchdog, replicas, Metrics(cfg.model.name, cfg.parallelism.data, cfg.model.max_model_len),
                        cfg.server.max_chars_per_token)
    app = build_app(bus, pipeline, cfg, replies, keys)
    server = EndingServer(uvicorn.Config(
        app, host=cfg.server.host, port=cfg.server.port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=2, lifespan="off", http=protocol_with(cfg.server.header_timeout_s),
    ), router, pipeline, cfg.server.drain_timeout_s)
    bus.start_heartbeat()
    bus.own_signals = True  # uvicorn's, through EndingServer: a drain must not be cut by the service's stop
    try:
        await server.serve(sockets=[sock])
    finally:
        bus.closing = True
        # Neither has anything left to finish: every request still open has failed (EndingServer.shutdown)
        # and the reply stream is deleted next. Cancelled, neither waits out a blocking read (redis.block_ms)
        # or its sleep of a heartbeat: the gateway stops in a tenth of a second, not one second.
        for task in (replies, watching):
            task.cancel()
        await asyncio.wait({replies, watching}, timeout=1)
        await bus.delete_stream(router.stream)  # a crashed gateway's stream stays, capped by MAXLEN


class EndingServer(uvicorn.Server):
    """The first SIGTERM or Ctrl-C drains (no new generation; those in flight finish, `drain_s` at
    most); then, or at a second signal, every request still open ends with a clean error (an error
    event and [DONE] for a stream) before uvicorn's grace period runs out and would cut it."""

    def __init__(self, config: uvicorn.Config, router: ReplyRouter, pipeline: Pipeline, drain_s: float) -> None:
        super().__init__(config)
        self.router = router
        self.pipeline = pipeline
        self.drain_s = drain_s
        self.drain_until: float | None = None  # set by the first signal
        self.said_draining = False

    def handle_exit(self, sig, frame) -> None:
        if self.drain_until is None and self.drain_s > 0:  # in a signal handler: only flags here
            self.drain_until = time.monotonic() + self.drain_s
            self.pipeline.draining = True
            self._captured_signals.append(sig)  # raised again once served: the service then stops (jaxstream.service)
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_until is not None and not self.should_exit:
            in_flight = self.pipeline.in_flight()
            if not self.said_draining:
                self.said_draining = True
                log.info("draining: %d requests in flight; no new ones; stopping when they finish, or in %g s", in_flight, self.drain_s)
            if not in_flight or time.monotonic() >= self.drain_until:
                if in_flight:
                    log.warning("drain timeout (%g s): ending the %d requests still in flight", self.drain_s, in_flight)
                self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        self.router.fail_all("the server is shutting down")
        await super().shutdown(sockets)


if __name__ == "__main__":
    run("gateway", main)
