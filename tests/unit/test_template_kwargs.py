"""vLLM's chat_template_kwargs: read and checked by the gateway (gateway/messages.py), rendered as
the template's variables by the tokenizer (Qwen3's enable_thinking), for chat and /tokenize alike."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gateway.errors import ApiError
from gateway.messages import template_kwargs
from jaxstream.protocol import ChatMessage, GenerateRequest, RequestRejected, SamplingParams, TokenizedRequest, TokenizeRequest
from tests.unit.test_tool_prompt import Templated
from tokenizer_svc.preprocess import Preprocessor

# Qwen3's switch, as its template writes it (the rest of the template shortened to ChatML)
QWEN3_LIKE = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{%- endif %}"""
CHAT = (ChatMessage("user", "hi"),)
NO_THINKING = json.dumps({"enable_thinking": False})


@pytest.fixture(scope="module")
def qwen3_like(tokenizer_info):
    return Preprocessor(dataclasses.replace(tokenizer_info, tokenizer=Templated(tokenizer_info.tokenizer, QWEN3_LIKE)), None)


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as caught:
        template_kwargs(body)
    assert caught.value.status == 400
    return caught.value


def test_the_gateway_passes_an_object_of_json_values_as_json_text():
    assert template_kwargs({}) is None and template_kwargs({"chat_template_kwargs": None}) is None
    assert template_kwargs({"chat_template_kwargs": {}}) is None
    value = {"enable_thinking": False, "names": ["a", {"b": None}], "depth": 2.5}
    assert json.loads(template_kwargs({"chat_template_kwargs": value})) == value


@pytest.mark.parametrize("value,param,says", [
    ([["enable_thinking", False]], "chat_template_kwargs", "must be an object"),
    ("enable_thinking=false", "chat_template_kwargs", "must be an object"),
    ({"tools": []}, "chat_template_kwargs.tools", "send 'tools', the request's own field"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt", "send 'add_generation_prompt'"),
    ({"enable_thinking": True, "tokenize": True}, "chat_template_kwargs.tokenize", "set by the server's call"),
    ({"chat_template": "{{ x }}"}, "chat_template_kwargs.chat_template", "not a variable a request may set"),
])
def test_what_is_no_template_variable_is_refused_naming_it(value, param, says):
    error = refused({"chat_template_kwargs": value})
    assert error.param == param and says in error.message, error.message


def test_the_tokenizer_renders_them_as_template_variables(qwen3_like, tokenizer_info):
    tok = tokenizer_info.tokenizer
    thinking = qwen3_like.render(CHAT, True)
    assert thinking.endswith("<|im_start|>assistant\n")
    assert qwen3_like.render(CHAT, True, template_kwargs=NO_THINKING) == thinking + "<think>\n\n</think>\n\n"
    # the prompt chat runs and the one /tokenize shows are the same
    ran = qwen3_like(GenerateRequest("r", "g", SamplingParams(), messages=CHAT, chat_template_kwargs=NO_THINKING))
    shown = qwen3_like(TokenizeRequest("t", "g", messages=CHAT, chat_template_kwargs=NO_THINKING))
    assert isinstance(ran, TokenizedRequest) and ran.input_ids == shown.token_ids
    assert tok.decode(ran.input_ids).endswith("</think>\n\n")


def test_the_tokenizer_refuses_kwargs_that_are_no_json_object(qwen3_like):
    for bad in ("[1]", "{"):
        reply = qwen3_like(TokenizeRequest("t", "g", messages=CHAT, chat_template_kwargs=bad))
        assert isinstance(reply, RequestRejected) and reply.param == "chat_template_kwargs"
