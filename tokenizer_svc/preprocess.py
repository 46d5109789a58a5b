"""Turning a client request into token ids, and refusing what cannot run. Pure: no I/O."""

from __future__ import annotations

from jaxstream.model_files import TokenizerInfo
from jaxstream.protocol import MAX_BANNED_TOKENS, GenerateRequest, RequestRejected, TokenizedRequest


class Preprocessor:
    def __init__(self, info: TokenizerInfo, max_model_len: int | None) -> None:
        self.info = info
        self.tokenizer = info.tokenizer
        self.max_model_len = max_model_len or info.context_length

    def __call__(self, req: GenerateRequest) -> TokenizedRequest | RequestRejected:
        try:
            ids = self.token_ids(req)
            return self.check(req, ids)
        except _Invalid as bad:
            return RequestRejected(req.rid, 400, bad.message, bad.param)

    def token_ids(self, req: GenerateRequest) -> list[int]:
        if req.input_ids is not None:
            return list(req.input_ids)
        if req.messages is not None:
            if not req.messages:
                raise _Invalid("messages must not be empty", "messages")
            messages = [{"role": m.role, "content": m.content} for m in req.messages]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return self.tokenizer.encode(text, add_special_tokens=False)
        if not req.text:
            raise _Invalid("prompt must not be empty", "prompt")
        return self.tokenizer.encode(req.text, add_special_tokens=req.add_special_tokens)

    def check(self, req: GenerateRequest, ids: list[int]) -> TokenizedRequest:
        vocab = self.info.vocab_size
        if not ids:
            raise _Invalid("prompt must not be empty", "prompt")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise _Invalid(f"token id {bad[0]} is out of vocabulary (ids must be in 0..{vocab - 1})", "prompt")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise _Invalid(
                f"This model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {len(ids)} tokens, leaving no room to generate",
                "prompt",
            )
        sampling = req.sampling
        wanted = sampling.max_new_tokens
        if wanted is not None and wanted > room:
            raise _Invalid(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(ids)} tokens and {wanted} more were requested ({len(ids) + wanted} in total)",
                "max_tokens",
            )
        stop_ids = tuple(dict.fromkeys(sampling.stop_token_ids if sampling.ignore_eos else sampling.stop_token_ids + self.info.eos_token_ids))
        if sampling.min_new_tokens > 1 and len(stop_ids) > MAX_BANNED_TOKENS:
            raise _Invalid(f"with min_tokens, at most {MAX_BANNED_TOKENS} stop token ids (EOS included) can be held "
                           f"back; got {len(stop_ids)}", "stop_token_ids")
        return TokenizedRequest(
            rid=req.rid,
            gateway=req.gateway,
            input_ids=tuple(ids),
            sampling=sampling,
            stop_token_ids=stop_ids,
            max_new_tokens=room if wanted is None else wanted,
        )


class _Invalid(Exception):
    def __init__(self, message: str, param: str) -> None:
        self.message, self.param = message, param
