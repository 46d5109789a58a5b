"""tokenizer_svc's pure logic with the real SmolLM2 tokenizer: /tokenize, /detokenize, chat templates,
validation of the vocabulary-bound sampling parameters, and the model facts of its heartbeat."""

from __future__ import annotations

import dataclasses

import pytest

from jaxstream import protocol
from jaxstream.protocol import (
    ChatMessage, DetokenizeRequest, GenerateRequest, RequestRejected, SamplingParams, TokenizedRequest,
    TokenizeReply, TokenizeRequest, TokenizerFacts,
)
from tokenizer_svc.preprocess import Preprocessor

CHAT = (ChatMessage("user", "hi"),)


@pytest.fixture(scope="module")
def pre(tokenizer_info):
    return Preprocessor(tokenizer_info, None)


def test_tokenize_text_with_token_strings(pre):
    reply = pre(TokenizeRequest("t", "g", text="Hello world", token_strs=True))
    assert reply == TokenizeReply("t", token_ids=(19556, 905), token_strs=("Hello", "Ġworld"), max_model_len=8192)
    assert pre(TokenizeRequest("t", "g", text="Hello world")).token_strs is None
    assert pre(TokenizeRequest("t", "g", text="")).token_ids == ()  # nothing to tokenize is no error


def test_tokenize_honours_max_model_len_override(tokenizer_info):
    reply = Preprocessor(tokenizer_info, 1024)(TokenizeRequest("t", "g", text="hi"))
    assert reply.max_model_len == 1024


def test_tokenize_chat_with_and_without_generation_prompt(pre, tokenizer_info):
    tok = tokenizer_info.tokenizer
    with_prompt = pre(TokenizeRequest("t", "g", messages=CHAT)).token_ids
    without = pre(TokenizeRequest("t", "g", messages=CHAT, add_generation_prompt=False)).token_ids
    assert tok.decode(with_prompt).endswith("<|im_start|>assistant\n")
    assert tok.decode(without).endswith("hi<|im_end|>\n")
    assert with_prompt[: len(without)] == without and len(with_prompt) > len(without)
    # The same ids /generate runs for the same messages.
    generate = pre(GenerateRequest("r", "g", SamplingParams(), messages=CHAT))
    assert isinstance(generate, TokenizedRequest) and generate.input_ids == with_prompt


def test_tokenize_add_special_tokens_reaches_the_tokenizer(tokenizer_info):
    calls = []

    class Spy:
        def __init__(self, tok):
            self.tok = tok

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def encode(self, text, add_special_tokens):
            calls.append(add_special_tokens)
            return self.tok.encode(text, add_special_tokens=add_special_tokens)

    pre = Preprocessor(dataclasses.replace(tokenizer_info, tokenizer=Spy(tokenizer_info.tokenizer)), None)
    pre(TokenizeRequest("t", "g", text="hi", add_special_tokens=False))
    pre(TokenizeRequest("t", "g", text="hi"))
    pre(TokenizeRequest("t", "g", messages=CHAT, add_special_tokens=True))  # the template brings its own
    assert calls == [False, True, False]


@pytest.mark.parametrize("request_, param", [
    (TokenizeRequest("t", "g"), "text"),
    (TokenizeRequest("t", "g", messages=()), "messages"),
    (DetokenizeRequest("t", "g", (1, 49152)), "tokens"),
    (DetokenizeRequest("t", "g", (-1,)), "tokens"),
])
def test_tokenize_and_detokenize_errors(pre, request_, param):
    reply = pre(request_)
    assert isinstance(reply, RequestRejected) and (reply.rid, reply.status, reply.param) == ("t", 400, param)
    if param == "tokens":
        assert str(request_.token_ids[-1]) in reply.message and "49151" in reply.message


def test_detokenize_honours_skip_special_tokens(pre, tokenizer_info):
    ids = (1, *tokenizer_info.tokenizer.encode("héllo 世界", add_special_tokens=False), 2)
    assert pre(DetokenizeRequest("d", "g", ids)) == TokenizeReply("d", token_ids=ids, text="héllo 世界", max_model_len=8192)
    kept = pre(DetokenizeRequest("d", "g", ids, skip_special_tokens=False))
    assert kept.text == "<|im_start|>héllo 世界<|im_end|>"
    assert pre(DetokenizeRequest("d", "g", ())).text == ""


def test_chat_without_a_template_is_a_400(tokenizer_info):
    class NoTemplate:
        chat_template = None

    pre = Preprocessor(dataclasses.replace(tokenizer_info, tokenizer=NoTemplate()), None)
    for request in (TokenizeRequest("t", "g", messages=CHAT), GenerateRequest("r", "g", SamplingParams(), messages=CHAT)):
        reply = pre(request)
        assert isinstance(reply, RequestRejected) and reply.param == "messages" and "chat template" in reply.message
    facts = pre.model_facts()
    assert (facts.has_chat_template, facts.bos_token_id) == (False, None)


def test_a_template_that_raises_is_a_400(pre):
    reply = pre(TokenizeRequest("t", "g", messages=(ChatMessage("user", "hi"),) * 2))  # SmolLM2's accepts this
    assert isinstance(reply, TokenizeReply)
    broken = Preprocessor(pre.info, None)
    broken.tokenizer = type("T", (), {"chat_template": "x", "apply_chat_template": lambda *a, **k: 1 / 0})()
    reply = broken(TokenizeRequest("t", "g", messages=CHAT))
    assert isinstance(reply, RequestRejected) and reply.param == "messages" and "division by zero" in reply.message


def generate(pre, **sampling) -> TokenizedRequest | RequestRejected:
    return pre(GenerateRequest("r", "g", SamplingParams(**sampling), input_ids=(5, 6, 7)))


def test_logit_bias_ids_must_be_in_the_vocabulary(pre):
    assert isinstance(generate(pre, logit_bias=((0, 1.0), (49151, -100.0))), TokenizedRequest)
    reply = generate(pre, logit_bias=((3, 1.0), (49152, 5.0)))
    assert isinstance(reply, RequestRejected) and (reply.status, reply.param) == (400, "logit_bias")
    assert "49152" in reply.message


def test_stop_token_ids_must_be_in_the_vocabulary(pre):
    reply = generate(pre, stop_token_ids=(50000,))
    assert isinstance(reply, RequestRejected) and reply.param == "stop_token_ids"
    assert reply.message == ("stop_token_ids: token id 50000 is out of vocabulary "
                             "(vocabulary size 49152: ids must be in 0..49151)")


def test_out_of_vocabulary_ids_are_all_named_with_the_vocabulary_size(pre):
    reply = pre(GenerateRequest("r", "g", SamplingParams(), input_ids=(5, 60000, 50000, 60000)))
    assert isinstance(reply, RequestRejected) and reply.param == "prompt"
    assert reply.message.startswith("prompt: token ids 50000 and 60000 are out of vocabulary (vocabulary size 49152")
    many = generate(pre, allowed_token_ids=tuple(range(50000, 50012)))  # the first 10 named, one line whatever the count
    assert "token ids 50000, 50001, 50002, 50003, 50004, 50005, 50006, 50007, 50008, 50009 and 2 more are" in many.message


def test_context_overflow_is_worded_as_the_routes_engine_words_it(tokenizer_info):
    pre = Preprocessor(tokenizer_info, 16)
    full = pre(GenerateRequest("r", "g", SamplingParams(), input_ids=(5,) * 16))
    assert isinstance(full, RequestRejected) and (full.param, full.code) == ("prompt", "context_length_exceeded")
    assert full.message == ("This model's maximum context length is 16 tokens. However, your request has 16 input tokens. "
                            "Please reduce the length of the input messages.")  # vLLM's
    native = pre(GenerateRequest("r", "g", SamplingParams(), input_ids=(5,) * 17, max_tokens_name="sampling_params.max_new_tokens"))
    assert native.message == "The input (17 tokens) is longer than the model's context length (16 tokens)."  # SGLang's
    for name in ("max_tokens", "max_completion_tokens"):
        over = pre(GenerateRequest("r", "g", SamplingParams(max_new_tokens=7), input_ids=(5,) * 10, max_tokens_name=name))
        assert isinstance(over, RequestRejected) and (over.param, over.code) == (name, "context_length_exceeded")
        assert over.message == ("'max_tokens' or 'max_completion_tokens' is too large: 7. This model's maximum context length "
                                "is 16 tokens and your request has 10 input tokens (7 > 16 - 10).")
    over = pre(GenerateRequest("r", "g", SamplingParams(max_new_tokens=7), input_ids=(5,) * 10, max_tokens_name="max_output_tokens"))
    assert over.message.startswith("'max_output_tokens' is too large: 7. This model's maximum context length is 16 tokens")
    name = "sampling_params[1].max_new_tokens"
    over = pre(GenerateRequest("r", "g", SamplingParams(max_new_tokens=7), input_ids=(5,) * 10, max_tokens_name=name))
    assert (over.param, over.code) == (name, "context_length_exceeded")
    assert over.message.startswith("Requested token count exceeds the model's maximum context length of 16 tokens. "
                                   "You requested a total of 17 tokens: 10 tokens from the input messages and 7 tokens for the completion.")


def test_an_empty_prompt_is_refused_in_vllms_words(pre):
    reply = pre(GenerateRequest("r", "g", SamplingParams(), text=""))
    assert isinstance(reply, RequestRejected) and reply.param == "prompt"
    assert "The decoder prompt cannot be empty" in reply.message


def test_allowed_token_ids_must_exist_and_leave_a_token_min_tokens_allows(pre):
    eos = pre.info.eos_token_ids[0]
    assert generate(pre, allowed_token_ids=(5, eos), min_new_tokens=2).sampling.allowed_token_ids == (5, eos)
    for sampling in ({"allowed_token_ids": (5, 50000)}, {"allowed_token_ids": (eos,), "min_new_tokens": 1}):
        reply = generate(pre, **sampling)
        assert isinstance(reply, RequestRejected) and reply.param == "allowed_token_ids", reply


def test_prompt_logprobs_must_start_inside_the_prompt(pre):
    assert generate(pre, prompt_logprobs_from=2).sampling.prompt_logprobs_from == 2
    reply = generate(pre, prompt_logprobs_from=3)
    assert isinstance(reply, RequestRejected) and reply.param == "logprob_start_len" and "3 tokens" in reply.message


def test_a_prefill_only_request_may_fill_the_context(tokenizer_info):
    # max_new_tokens 0 scores a prompt (an RL trajectory of the whole context, say): no room is needed
    pre = Preprocessor(tokenizer_info, 3)
    scored = generate(pre, max_new_tokens=0, prompt_logprobs_from=0)
    assert isinstance(scored, TokenizedRequest) and scored.finish.max_new_tokens == 0
    for wanted in (1, None):  # a request that samples needs room for a token
        reply = generate(pre, max_new_tokens=wanted)
        assert isinstance(reply, RequestRejected) and reply.param == "prompt" and "your request has 3 input tokens" in reply.message
    over = Preprocessor(tokenizer_info, 2)(GenerateRequest("r", "g", SamplingParams(max_new_tokens=0), input_ids=(5, 6, 7)))
    assert isinstance(over, RequestRejected) and "maximum context length is 2 tokens. However, your request has 3 input" in over.message


def test_model_facts_for_the_heartbeat(pre):
    facts = pre.model_facts()
    assert facts == TokenizerFacts(max_model_len=8192, vocab_size=49152, eos_token_ids=(2,), bos_token_id=1,
                                   has_chat_template=True)
    assert protocol.decoder(TokenizerFacts).decode(protocol.encode(facts)) == facts  # as the heartbeat carries them


def _prompt(pre, **fields) -> tuple[int, ...]:
    out = pre(GenerateRequest("r", "g", SamplingParams(max_new_tokens=4), **fields))
    assert isinstance(out, TokenizedRequest), out
    return out.input_ids


def test_truncate_prompt_tokens_keeps_the_prompts_end(pre):
    whole = _prompt(pre, text="one two three four five six")
    assert _prompt(pre, text="one two three four five six", truncate_prompt_tokens=3) == whole[-3:]
    assert _prompt(pre, text="one two", truncate_prompt_tokens=50) == _prompt(pre, text="one two")  # shorter: whole
    assert _prompt(pre, input_ids=tuple(range(10, 20)), truncate_prompt_tokens=4) == (16, 17, 18, 19)
    assert _prompt(pre, input_ids=tuple(range(10, 20)), truncate_prompt_tokens=4, truncate_left=False) == (10, 11, 12, 13)
    long = tuple(range(10, 9000))  # longer than the context (8192): -1 keeps what it holds, then room is checked
    rejected = pre(GenerateRequest("r", "g", SamplingParams(max_new_tokens=4), input_ids=long, truncate_prompt_tokens=-1))
    assert isinstance(rejected, RequestRejected) and "your request has 8192 input tokens" in rejected.message
    kept = pre(GenerateRequest("r", "g", SamplingParams(max_new_tokens=0), input_ids=long, truncate_prompt_tokens=-1))
    assert kept.input_ids == long[-8192:]
    too_many = pre(GenerateRequest("r", "g", SamplingParams(), text="hi", truncate_prompt_tokens=9000))
    assert isinstance(too_many, RequestRejected) and too_many.param == "truncate_prompt_tokens"
    assert "greater than max_model_len (8192)" in too_many.message


def test_a_final_assistant_message_is_continued_without_its_end_of_turn(pre, tokenizer_info):
    tok = tokenizer_info.tokenizer
    chat = (ChatMessage("user", "Say a saying"), ChatMessage("assistant", "An apple a day"))
    continued = tok.decode(_prompt(pre, messages=chat, add_generation_prompt=False, continue_final_message=True))
    assert continued.endswith("<|im_start|>assistant\nAn apple a day")
    closed = tok.decode(_prompt(pre, messages=chat))  # a new assistant turn after the closed one
    assert closed.endswith("An apple a day<|im_end|>\n<|im_start|>assistant\n")
