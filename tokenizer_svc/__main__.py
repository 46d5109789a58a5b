"""tokenizer_svc: client requests in, token ids out. Stateless: run more processes to scale.

1. Read GenerateRequests, TokenizeRequests and DetokenizeRequests from the tokenizer stream
   (consumer group `tokenizer`: several processes share it, and one that dies has its pending
   entries claimed by another).
2. Render chat messages with the model's chat template, tokenize text, or take the given ids.
3. Validate (non-empty, ids in the vocabulary, logit-bias and stop ids too, room left in the
   context) and resolve the finish rule's inputs (EOS joins the stop ids unless ignore_eos;
   max_new_tokens capped by the context).
4. Publish a TokenizedRequest to the scheduler of the replica the gateway chose
   (GenerateRequest.replica); a TokenizeReply (/tokenize, /detokenize) or a RequestRejected to the
   request's gateway.
5. The heartbeat's stats carry the model facts only the tokenizer knows (max_model_len,
   vocab_size, eos_token_ids, ...) for the gateway's /get_model_info and length checks.
"""

from __future__ import annotations

import asyncio

from jaxstream import protocol
from jaxstream.config import AppConfig
from jaxstream.model_files import load_tokenizer
from jaxstream.service import run
from jaxstream.transport import Bus
from tokenizer_svc.preprocess import Preprocessor, Reply


async def main(cfg: AppConfig, bus: Bus) -> None:
    bus.phase = "loading the tokenizer"
    tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model)  # meanwhile the bus says so
    preprocess = Preprocessor(tokenizer, cfg.model.max_model_len)
    inbox = bus.consumer([bus.keys.tokenizer], protocol.decoder(protocol.TokenizerInput))
    await inbox.ensure_groups(from_start=False)
    facts = preprocess.model_facts()
    processed = 0
    bus.stats = protocol.TokenizerStats(facts=facts, processed=processed, reclaimed=inbox.reclaimed)
    bus.start_heartbeat()
    async for batch in inbox.batches():
        await bus.publish_many([route(bus, request, preprocess(request)) for _, request in batch])
        processed += len(batch)
        bus.stats = protocol.TokenizerStats(facts=facts, processed=processed, reclaimed=inbox.reclaimed)


def route(bus: Bus, request: protocol.TokenizerInput, reply: Reply) -> tuple[str, object]:
    if isinstance(reply, protocol.TokenizedRequest):
        assert isinstance(request, protocol.GenerateRequest)
        return bus.keys.scheduler(request.replica), reply
    return bus.keys.gateway(request.gateway), reply


if __name__ == "__main__":
    run("tokenizer", main)
