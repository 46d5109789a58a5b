"""detokenizer_svc: sampled token ids in, text out, one message per step per gateway.

1. Read, in one blocking read, request events from the schedulers (this instance's detokenizer
   stream: starts with each request's stop rules and replica, ends for aborts) and step results from
   the workers (every replica's results stream, in a group of this instance's own: the replica's
   scheduler and every other detokenizer read it too). Events are read first, so a request is known
   before its tokens. Run more detokenizers to scale: each scheduler spreads requests over them.
2. Per request: incremental detokenization (never a broken UTF-8 character), stop strings (text
   that could still become one is held back), and the shared finish rule on stop ids and length.
   As the request asked: each token's own text, its top alternatives, and the prompt's logprobs
   (a step's scores are taken before its tokens; all of them go out with the first output); for
   a chat of a Harmony model (GPT-OSS), the text by channel, read with openai-harmony.
3. Publish one OutputBatch per gateway; tell each replica's scheduler which of its requests a stop
   string ended.
4. Order is checked, not assumed: step results by step id per replica (service.py: a duplicate is
   dropped, a gap fails the requests it may have cut), and every output of a request carries its
   number (RequestOutput.seq), which the gateway checks the same way.
"""

from __future__ import annotations

import asyncio

from jaxstream import harmony, protocol
from jaxstream.config import AppConfig
from jaxstream.model_files import load_tokenizer
from jaxstream.service import run
from jaxstream.transport import Bus
from detokenizer_svc.service import Detokenizer

INBOX = protocol.DetokenizerInput | protocol.WorkerOutput


async def main(cfg: AppConfig, bus: Bus) -> None:
    bus.phase = "loading the tokenizer"
    tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model)  # meanwhile the bus says so
    if cfg.model.harmony:  # loaded once here, so a missing vocabulary stops the start, named (jaxstream/harmony.py)
        bus.phase = "loading openai-harmony's encoding"
        await asyncio.to_thread(harmony.encoding)
    detok = Detokenizer(tokenizer.tokenizer)
    # Its own group on each results stream: every detokenizer sees every step of every replica and
    # keeps the tokens of the requests the schedulers gave it (on its own event stream).
    results = [bus.keys.results(r) for r in range(cfg.parallelism.data)]
    inbox = bus.consumer([bus.keys.detokenizer(bus.name), *results], protocol.decoder(INBOX), group=bus.name)
    await inbox.ensure_groups(from_start=False)
    bus.on_restart(detok.reset)
    bus.start_heartbeat()
    async for batch in inbox.batches():
        outputs, stopped = detok.step([message for _, message in batch])
        # Stops first: the scheduler ends the request (and writes its stats) while the outputs travel.
        items: list[tuple[str, object]] = [
            (bus.keys.scheduler(replica), protocol.StopRequests(tuple(rids))) for replica, rids in stopped.items()
        ]
        items += [(bus.keys.gateway(gateway), protocol.OutputBatch(tuple(outs))) for gateway, outs in outputs.items()]
        await bus.publish_many(items)
        bus.stats = protocol.DetokenizerStats(requests=len(detok.requests), started=detok.started)


if __name__ == "__main__":
    run("detokenizer", main)
