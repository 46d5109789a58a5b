"""The tokenizer's work off its loop (tokenizer_svc/lanes.py) and its bound on characters before it
encodes (jaxstream/prompt_limit.py), with the real SmolLM2 tokenizer."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

from jaxstream.config import ServerConfig
from jaxstream.protocol import (
    ChatMessage, DetokenizeRequest, GenerateRequest, RequestRejected, SamplingParams, TokenizedRequest, TokenizeReply, TokenizeRequest,
    ToolCall,
)
from tokenizer_svc.lanes import SMALL_CHARS, size
from tokenizer_svc.preprocess import Preprocessor


class Counting:
    """The tokenizer, counting what it is asked to encode."""

    def __init__(self, tok) -> None:
        self.tok, self.encoded = tok, []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text, add_special_tokens):
        self.encoded.append(len(text))
        return self.tok.encode(text, add_special_tokens=add_special_tokens)


def test_a_prompt_no_context_holds_is_refused_before_it_is_encoded(tokenizer_info):
    tok = Counting(tokenizer_info.tokenizer)
    pre = Preprocessor(dataclasses.replace(tokenizer_info, tokenizer=tok), 64, chars_per_token=4)  # 256 characters at most
    for request, param in ((GenerateRequest("r", "g", SamplingParams(), text="a " * 200), "prompt"),
                           (GenerateRequest("r", "g", SamplingParams(), messages=(ChatMessage("user", "a " * 120),)), "messages")):
        refused = pre(request)
        assert isinstance(refused, RequestRejected) and refused.param == param and refused.code == "context_length_exceeded"
        assert "maximum context length is 64 tokens" in refused.message and "256 characters" in refused.message
    assert tok.encoded == []  # neither was encoded: the rendered chat (with its template's text) is what counted
    cut = pre(GenerateRequest("r", "g", SamplingParams(max_new_tokens=1), text="a " * 200, truncate_prompt_tokens=8))
    assert isinstance(cut, TokenizedRequest) and len(cut.input_ids) == 8 and tok.encoded == [400]  # truncation keeps what fits
    fits = pre(GenerateRequest("r", "g", SamplingParams(max_new_tokens=1), text="a " * 20))
    assert isinstance(fits, TokenizedRequest)
    counted = pre(TokenizeRequest("t", "g", text="a " * 200))  # /tokenize counts any text's tokens, refusing none
    assert isinstance(counted, TokenizeReply) and len(counted.token_ids) > 64


def test_the_longest_vocabulary_entry_is_within_the_default_bound(tokenizer_info):
    """server.max_chars_per_token is safe for a tokenizer whose entries are no longer (the tokenizer
    warns at start-up otherwise): SmolLM2's longest is a run of spaces after a newline."""
    longest = Preprocessor(tokenizer_info, None).longest_entry()
    assert 16 <= longest <= ServerConfig.max_chars_per_token
    text = "\n" + " " * (longest - 1)
    assert len(tokenizer_info.tokenizer.encode(text, add_special_tokens=False)) == 1


def test_size_counts_what_the_work_grows_with():
    sampling = SamplingParams()
    assert size(GenerateRequest("r", "g", sampling, text="abc")) == 3
    assert size(GenerateRequest("r", "g", sampling, input_ids=(1, 2))) == 2
    chat = (ChatMessage("user", "hello"), ChatMessage("assistant", "", tool_calls=(ToolCall("c", "f", '{"a": 1}'),)))
    assert size(GenerateRequest("r", "g", sampling, messages=chat, tools="[]")) == 5 + 8 + 2
    assert size(TokenizeRequest("t", "g", text="x" * (SMALL_CHARS + 1))) > SMALL_CHARS
    assert size(DetokenizeRequest("t", "g", (1, 2, 3))) == 3


def test_preprocessing_from_many_threads_at_once_gives_what_one_gives(tokenizer_info):
    """Lanes call one Preprocessor from their pools' threads: it must hold nothing of a request."""
    pre = Preprocessor(tokenizer_info, None)
    requests = [GenerateRequest(f"r{i}", "g", SamplingParams(max_new_tokens=1), text=f"number {i} " * (i % 50 + 1)) if i % 2 else
                GenerateRequest(f"r{i}", "g", SamplingParams(max_new_tokens=1), messages=(ChatMessage("user", f"hi {i}"),))
                for i in range(200)]
    alone = [pre(r) for r in requests]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(pre, requests)) == alone
