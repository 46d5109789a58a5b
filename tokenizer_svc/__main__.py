"""tokenizer_svc: client requests in, token ids out. Stateless: run more processes to scale.

1. Read GenerateRequests, TokenizeRequests and DetokenizeRequests from the tokenizer stream
   (consumer group `tokenizer`: several processes share it, and one that dies has its pending
   entries claimed by another).
2. Render chat messages with the model's chat template (a Harmony model's, GPT-OSS, with
   openai-harmony: harmony_prompt.py), tokenize text, or take the given ids, in
   threads, never on the loop (lanes.py): a small prompt in a batch with others, a large one handed
   to a lane of its own, so that one prompt delays only itself and the heartbeat never waits.
3. Validate (non-empty, ids in the vocabulary, logit-bias and stop ids too, room left in the
   context; a prompt of more characters than the context can hold before it is tokenized) and
   resolve the finish rule's inputs (EOS joins the stop ids unless ignore_eos; max_new_tokens
   capped by the context).
4. Publish a TokenizedRequest to the scheduler of the replica the gateway chose
   (GenerateRequest.replica); a TokenizeReply (/tokenize, /detokenize) or a RequestRejected to the
   request's gateway.
5. The heartbeat's stats carry the model facts only the tokenizer knows (max_model_len,
   vocab_size, eos_token_ids, ...) for the gateway's /get_model_info and length checks.
"""

from __future__ import annotations

import asyncio
import logging

from jaxstream import harmony
from jaxstream.config import AppConfig
from jaxstream.model_files import load_tokenizer
from jaxstream.service import run
from jaxstream.transport import Bus
from tokenizer_svc.harmony_prompt import HarmonyPrompt
from tokenizer_svc.lanes import Lanes
from tokenizer_svc.preprocess import Preprocessor

log = logging.getLogger("tokenizer_svc")


async def main(cfg: AppConfig, bus: Bus) -> None:
    bus.phase = "loading the tokenizer"
    tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model)  # meanwhile the bus says so
    prompts = None
    if cfg.model.harmony:  # GPT-OSS: chats rendered by openai-harmony (a missing vocabulary stops the start, named)
        bus.phase = "loading openai-harmony's encoding"
        prompts = HarmonyPrompt(await asyncio.to_thread(harmony.encoding))
    preprocess = Preprocessor(tokenizer, cfg.model.max_model_len, cfg.server.max_chars_per_token, prompts)
    if (longest := preprocess.longest_entry()) > cfg.server.max_chars_per_token:
        log.warning("the vocabulary has an entry of %d characters, more than server.max_chars_per_token (%d): a prompt "
                    "of such tokens could be refused though it fits; set it to %d", longest, cfg.server.max_chars_per_token,
                    longest)
    lanes = Lanes(bus, preprocess)
    await lanes.ensure_groups()
    bus.stats = lanes.stats()
    bus.start_heartbeat()
    await lanes.run()


if __name__ == "__main__":
    run("tokenizer", main)
