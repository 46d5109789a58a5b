"""A thinking model served whole through the fake stack, with the official client:
chat_template_kwargs reach the chat template, reasoning_content is split from content (whole and
streamed, a tag split over two outputs still found), and a call after the thinking is read in
Mistral's syntax (model.reasoning_parser=qwen3, model.tool_parser=mistral).

The fake worker writes ids a + 1, a + 2, ... after the prompt's last id a (worker_svc/fake.py), so
this stack's tokenizer is one written here whose consecutive ids spell recorded outputs: a prompt
that ends with a script's marker word is answered by that script, token by token, up to the
script's own end token (one of the EOS ids). Its template names the marker the user sent, or
`@nothink` when told `enable_thinking: false`, as Qwen3's template closes the thinking then.
The parsers' every case is in tests/unit/test_reasoning.py and test_tool_syntaxes.py."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support import serve

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
MODEL = "SmolLM2-135M-Instruct"
SCRIPTS = {  # marker -> the output's tokens (every token a distinct vocabulary entry)
    "@think": ["<think>", "\nThe user", " asks about", " Paris.", "\n</thi", "nk>", "\n\nParis is", " sunny."],
    "@nothink": ["Paris", " is", " sunny", " today."],
    "@call": ["<think>\nI should", " call a tool.", "</think>", "[TOOL_CALLS]", ' [{"name": "get_weather",',
              ' "arguments": {"city":', ' "Paris"}}]'],
}
TEMPLATE = ("{%- for m in messages %}{{ m['content'] }} {% endfor %}"
            "{%- if enable_thinking is defined and enable_thinking is false %}@nothink{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def scripted_tokenizer(where) -> str:
    """A Hugging Face tokenizer directory whose ids after each marker spell its script, then its end."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    words, ends = ["<unk>"], []
    for marker, pieces in SCRIPTS.items():
        words += [marker, *pieces, f"<end{marker}>"]
        ends.append(f"<end{marker}>")
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.Fuse()  # the pieces joined as written
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "[TOOL_CALLS]", *ends)])
    tokenizer.save(str(where / "tokenizer.json"))
    (where / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": ends[0], "chat_template": TEMPLATE}))
    (where / "config.json").write_text(json.dumps({"eos_token_id": [words.index(e) for e in ends]}))
    return str(where)


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    directory = scripted_tokenizer(tmp_path_factory.mktemp("scripted_tokenizer"))
    yield from serve(redis_url, "worker=fake", f"model.tokenizer={directory}", "model.reasoning_parser=qwen3",
                     "model.tool_parser=mistral")


def ask(marker: str) -> list[dict]:
    return [{"role": "user", "content": marker}]


def streamed(client, **fields) -> tuple[list, str, str, list]:
    """The chunks, and the reasoning, content and tool-call deltas they add up to."""
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, max_tokens=20, **fields))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    return (chunks, "".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
            "".join(d.content or "" for d in deltas), [t for d in deltas for t in d.tool_calls or []])


def test_the_thinking_is_reasoning_content_and_the_answer_content(client):
    message = client.chat.completions.create(model=MODEL, messages=ask("@think"), max_tokens=20).choices[0].message
    assert message.reasoning_content == message.reasoning == "\nThe user asks about Paris.\n"
    assert message.content == "\n\nParis is sunny."
    # streamed, one token per output: "</thi" + "nk>" is still the end of the thinking
    chunks, reasoning, content, calls = streamed(client, messages=ask("@think"))
    assert (reasoning, content, calls) == (message.reasoning_content, message.content, [])
    assert all(not (c.choices[0].delta.content and getattr(c.choices[0].delta, "reasoning_content", None)) for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_chat_template_kwargs_reach_the_template_and_the_reasoning_parser(client, stack):
    told = {"chat_template_kwargs": {"enable_thinking": False}}
    r = client.chat.completions.create(model=MODEL, messages=ask("@think"), max_tokens=20, extra_body=told)
    assert r.choices[0].message.content == "Paris is sunny today." and r.choices[0].message.reasoning_content is None
    assert streamed(client, messages=ask("@think"), extra_body=told)[1:] == ("", "Paris is sunny today.", [])
    tokens = httpx.post(stack + "/tokenize", json={"model": MODEL, "messages": ask("@think"), **told}, timeout=10).json()["tokens"]
    assert len(tokens) == r.usage.prompt_tokens == 2  # "@think @nothink": the prompt chat ran
    bad = httpx.post(stack + "/v1/chat/completions", json={"model": MODEL, "messages": ask("@think"),
                                                           "chat_template_kwargs": {"tools": []}}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs.tools"
    for route, body in (("/v1/chat/completions", {"messages": ask("@think")}), ("/v1/responses", {"input": "@think"})):
        for kwargs in ("x", [1]):  # no object: a 400 on every route, before the reasoning parser reads it
            bad = httpx.post(stack + route, json={"model": MODEL, **body, "chat_template_kwargs": kwargs}, timeout=10)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs", (route, bad.text)


def test_a_call_after_the_thinking_is_read_in_mistrals_syntax(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("@call"), tools=[WEATHER], max_tokens=20)
    choice = r.choices[0]
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert len(call.id) == 9 and call.id.isalnum()  # Mistral's template takes back no other id
    assert choice.message.reasoning_content == "\nI should call a tool." and choice.message.content is None
    assert choice.finish_reason == "tool_calls"
    chunks, reasoning, content, calls = streamed(client, messages=ask("@call"), tools=[WEATHER])
    assert (reasoning, content) == ("\nI should call a tool.", "")
    assert calls[0].function.name == "get_weather" and "".join(c.function.arguments for c in calls) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_the_responses_api_puts_the_thinking_in_a_reasoning_item(client):
    r = client.responses.create(model=MODEL, input="@think", max_output_tokens=20)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == ["\nThe user asks about Paris.\n"]
    assert message.type == "message" and r.output_text == "\n\nParis is sunny." and r.status == "completed"
    events = list(client.responses.create(model=MODEL, input="@think", max_output_tokens=20, stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, answer) == (reasoning.content[0].text, r.output_text)
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")] and events[-1].response.output[1].content[0].text == answer
    told = client.responses.create(model=MODEL, input="@think", max_output_tokens=20,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [item.type for item in told.output] == ["message"] and told.output_text == "Paris is sunny today."
