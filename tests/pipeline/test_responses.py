"""`/v1/responses` driven by the official openai client (typed objects, the stream helper) against
the whole stack with the fake worker (a prompt ending in token t continues t+1, t+2, ...; token t's
logprob is -(t % 10) / 10), and once against SmolLM2's real weights: the same text as chat."""

import asyncio
import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseFailedEvent, ResponseOutputMessage, ResponseOutputText, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.errors import ApiError
from gateway.responses_routes import ResponseShape, ResponseStore
from jaxstream.protocol import ChatMessage, RequestOutput
from tests.support import assert_idle, chat_prompt_ids

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
ECHOED = {"instructions": None, "max_output_tokens": None, "temperature": 1.0, "top_p": 1.0, "tools": [], "tool_choice": "auto",
          "parallel_tool_calls": True, "metadata": {}}  # a request's settings, as the route echoes them


@pytest.fixture(scope="module")
def stack(fake_stack):
    return fake_stack


def continuation_text(tokenizer_info, last: int, n: int) -> str:
    ids = [(last + i) % tokenizer_info.vocab_size for i in range(1, n + 1)]
    return tokenizer_info.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def chat_text(client, messages: list[dict], max_tokens: int, **extra) -> str:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_body=extra).choices[0].message.content


def test_string_input_cut_by_max_output_tokens_is_incomplete(client, tokenizer_info):
    ids = chat_prompt_ids(tokenizer_info.tokenizer, QUESTION)
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=5, metadata={"run": "a"})
    Response.model_validate(r.to_dict())  # strictly: every field OpenAI's type requires, of its type
    assert isinstance(r, Response) and r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    (message,) = r.output
    assert isinstance(message, ResponseOutputMessage) and message.id.startswith("msg_") and message.role == "assistant"
    (part,) = message.content
    assert isinstance(part, ResponseOutputText) and part.annotations == [] and part.logprobs == []
    assert r.output_text == part.text == continuation_text(tokenizer_info, ids[-1], 5)
    assert (r.status, r.incomplete_details.reason, message.status) == ("incomplete", "max_output_tokens", "incomplete")
    usage = r.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (len(ids), 5, len(ids) + 5)
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0
    assert (r.max_output_tokens, r.temperature, r.top_p, r.tools, r.tool_choice, r.error) == (5, 1.0, 1.0, [], "auto", None)
    assert r.text.format.type == "text" and r.parallel_tool_calls is True and r.metadata["run"] == "a"


def test_messages_and_instructions_run_as_the_same_chat(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
             {"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Name a color."}]
    r = client.responses.create(model=MODEL, input=items, instructions="Be brief.", max_output_tokens=30,
                                temperature=0)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Name a color."}]
    assert r.output_text == chat_text(client, chat, 30) and r.instructions == "Be brief."


def test_stream_gives_the_events_and_text_of_the_plain_response(client, tokenizer_info):
    ids = chat_prompt_ids(tokenizer_info.tokenizer, QUESTION)
    stop = (ids[-1] + 6) % tokenizer_info.vocab_size  # the sixth token ends it: status completed
    plain = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=40, extra_body={"stop_token_ids": [stop]})
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=40, extra_body={"stop_token_ids": [stop]}) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == plain.output_text == events[-4].text
    assert final.status == plain.status == "completed" and final.incomplete_details is None
    assert final.usage.output_tokens == plain.usage.output_tokens == 6 and final.id == events[0].response.id != plain.id


def test_stream_cut_by_max_output_tokens_ends_incomplete(client):
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, stream=True))
    for event in events:  # strictly, as the string input's response
        TypeAdapter(ResponseStreamEvent).validate_python(event.to_dict())
    assert events[-1].type == "response.incomplete" and events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 3 and events[-2].item.status == "incomplete"


def test_logprobs_are_chats(client):
    question = [{"role": "user", "content": QUESTION}]
    r = client.responses.create(model=MODEL, input=question, max_output_tokens=4, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    chat = client.chat.completions.create(model=MODEL, messages=question, max_tokens=4, logprobs=True, top_logprobs=2)
    ours = r.output[0].content[0].logprobs
    assert [(x.token, x.logprob, [(t.token, t.logprob) for t in x.top_logprobs]) for x in ours] == \
        [(x.token, x.logprob, [(t.token, t.logprob) for t in x.top_logprobs]) for x in chat.choices[0].logprobs.content]
    streamed = list(client.responses.create(model=MODEL, input=question, max_output_tokens=4, top_logprobs=2, stream=True))
    assert [x.logprob for e in streamed if e.type == "response.output_text.delta" for x in e.logprobs] == [x.logprob for x in ours]


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="Hi", instructions="Be brief.", max_output_tokens=3)
    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=4)
    # OpenAI's rule: the earlier instructions are not carried over
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"}]
    assert second.output_text == chat_text(client, chat, 4) and second.previous_response_id == first.id
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="More", previous_response_id=unstored.id)
    assert refused.value.body["param"] == "previous_response_id" and refused.value.body["code"] == "previous_response_not_found"


@pytest.mark.parametrize("field,value,param", [
    ("tools", [{"type": "function", "name": "f", "parameters": {}}], "tools"),
    ("tool_choice", "required", "tool_choice"),
    ("reasoning", {"effort": "high"}, "reasoning"),
    ("text", {"verbosity": "low"}, "text"),
    ("text", {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}, "text.format.schema"),
    ("response_format", {"type": "json_object"}, "response_format"),
    ("background", True, "background"),
    ("include", ["file_search_call.results"], "include"),
    ("truncation", "auto", "truncation"),
    ("conversation", "conv_1", "conversation"),
    ("prompt", {"id": "pmpt_1"}, "prompt"),
    ("regex", "[a-", "regex"),
    ("input", [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_image", "image_url": "x"}]}],
     "input[0].content[1].type"),
    ("input", [{"type": "function_call_output", "call_id": "c", "output": "1"}], "input[0].type"),
    ("input", "", "input"),
    ("metadata", {"k": 1}, "metadata"),
    ("max_output_tokens", 0, "max_output_tokens"),
    ("top_logprobs", 21, "top_logprobs"),
])
def test_what_is_not_built_is_a_400_naming_it(stack, field, value, param):
    r = httpx.post(stack + "/v1/responses", json={"model": MODEL, "input": "Hi", field: value}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_an_unknown_model_is_404_and_accepted_fields_pass(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="Hi")
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=True, user="u", parallel_tool_calls=False,
                                truncation="disabled", tool_choice="none", tools=[], reasoning={"effort": "none"},
                                text={"format": {"type": "text"}}, extra_body={"top_k": 5, "min_p": 0.1, "seed": 3})
    assert r.usage.output_tokens == 2 and r.tool_choice == "none" and r.parallel_tool_calls is False


def test_leaving_a_stream_early_aborts_it(stack):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 8000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", stack + "/v1/responses", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines) == "event: response.created" and json.loads(next(lines)[6:])["sequence_number"] == 0
    assert_idle(stack, timeout=3)  # aborted: its 8000 tokens alone would take the fake worker ~10 s


def test_a_failure_after_the_stream_began_ends_it_with_response_failed():
    async def outputs():
        yield 0, RequestOutput("r", text="Hel", token_ids=(1,), completion_tokens=1)
        raise ApiError(503, "the worker stopped")

    async def events() -> list[dict]:
        return [e async for e in ResponseShape("r", MODEL, None, ECHOED).events(outputs(), None)]

    shaped = asyncio.run(events())
    assert [e["type"] for e in shaped][-2:] == ["response.output_text.delta", "response.failed"]
    failed = ResponseFailedEvent.model_validate(shaped[-1])  # strictly: OpenAI's type, every required field
    assert (failed.response.status, failed.response.error.code) == ("failed", "server_error")
    assert failed.response.error.message == "the worker stopped"
    assert failed.response.output[0].content[0].text == "Hel" and failed.sequence_number == len(shaped) - 1


def test_the_store_keeps_the_last_conversations():
    store = ResponseStore(size=2)
    for name in ("a", "b", "c"):
        store.put(name, (ChatMessage("user", name),), {"id": name})
    assert store.get("c") == (ChatMessage("user", "c"),) and store.response("b") == {"id": "b"}  # b read last: c goes next
    store.put("d", (), {"id": "d"})
    with pytest.raises(ApiError) as gone:
        store.get("c")
    assert gone.value.param == "previous_response_id" and list(store.entries) == ["b", "d"]
    with pytest.raises(ApiError) as gone:
        store.response("c")
    assert (gone.value.status, gone.value.param, gone.value.message) == (404, "response_id", "Response with id 'c' not found.")


def test_a_stored_response_is_retrieved_and_deleted_with_the_official_client(client, stack):
    made = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3)
    assert (made.usage.prompt_tokens, made.usage.completion_tokens) == (made.usage.input_tokens, made.usage.output_tokens) != (0, 0)
    again = client.responses.retrieve(made.id)
    assert again.to_dict() == made.to_dict() and again.status == "incomplete"
    unstored = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=1, store=False)
    client.responses.delete(made.id)
    for gone in (made.id, unstored.id):
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.retrieve(gone)
        assert missing.value.body["message"] == f"Response with id '{gone}' not found." and missing.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(made.id)
    bad = httpx.get(stack + "/v1/responses/chatcmpl-1", timeout=10)
    assert bad.status_code == 400 and "Expected an ID that begins with 'resp'" in bad.json()["error"]["message"]


def test_a_streamed_incomplete_response_ends_as_the_sdk_expects_of_openais(client):
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=4) as stream:
        events = list(stream)
        # the SDK's helper ends an incomplete stream so for OpenAI's own too: no response.completed event
        with pytest.raises(RuntimeError, match="Didn't receive a `response.completed` event."):
            stream.get_final_response()
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens" and last.response.usage.completion_tokens == 4
    assert last.response.output_text and client.responses.retrieve(last.response.id).output_text == last.response.output_text


def test_greedy_text_is_the_chat_completions_on_the_real_model(jax_stack):
    client = openai.OpenAI(base_url=jax_stack + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0)
    assert r.output_text and r.output_text == chat_text(client, [{"role": "user", "content": QUESTION}], 12)
    assert_idle(jax_stack)
