"""OpenAI's chat messages, as chat completions and /tokenize read them: roles, text content (a
string or text parts), an assistant's tool calls and a tool message's answer to one.

A role is any non-empty string, as vLLM takes it (entrypoints/chat_utils.py,
CustomChatCompletionMessageParam and _parse_chat_message_content: `role = message["role"]`, passed
on): a role other than OpenAI's (system, user, assistant, developer, tool) goes to the chat template
as given, and what the template makes of it is the template's business (one that refuses it is the
tokenizer's 400, naming the template's reason). "developer" is the template's "system".

vLLM's `chat_template_kwargs` go with them: extra variables of the template (Qwen3's
`enable_thinking`), read by `template_kwargs`."""

from __future__ import annotations

import json

from gateway.params import check, get
from jaxstream.protocol import ChatMessage, ToolCall

# What the tokenizer's apply_chat_template call sets itself, or takes as its own keyword (transformers'
# signature): as a template variable one would clash with the request's own field or change what the
# call returns. vLLM refuses chat_template and tokenize by name and lets its own fields be overridden;
# here each is refused, naming the request's field that says it where there is one.
TEMPLATE_CALL = {
    "messages": "messages", "conversation": "messages", "tools": "tools", "documents": "",
    "add_generation_prompt": "add_generation_prompt", "continue_final_message": "continue_final_message",
    "chat_template": "", "tokenize": "", "sanitize_control_tokens": "", "padding": "", "truncation": "", "max_length": "",
    "return_tensors": "", "return_dict": "", "return_assistant_tokens_mask": "", "tokenizer_kwargs": "",
}


def chat_messages(body: dict) -> tuple[ChatMessage, ...]:
    messages = get(body, "messages", list, None)
    check(bool(messages), "messages", "must be a non-empty array")
    out = []
    for i, message in enumerate(messages):
        name = f"messages[{i}]"
        check(isinstance(message, dict), name, "must be an object")
        role = get(message, "role", str, None, prefix=f"{name}.")
        check(bool(role), f"{name}.role", "is required: a non-empty string (system, user, assistant, developer, tool, "
                                           "or a role of the model's chat template)")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                ok = isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                check(ok, f"{name}.content[{j}]", "must be a text part ({\"type\": \"text\", \"text\": ...}); other part types are not supported")
                parts.append(part["text"])
            content = "".join(parts)
        calls = tool_calls(message, name) if role == "assistant" else ()
        # an assistant's thinking, as vLLM reads it back (its newer name first): a Harmony model's analysis; templates get none
        thought = next((message[k] for k in ("reasoning", "reasoning_content") if message.get(k) is not None), None)
        check(role != "assistant" or thought is None or isinstance(thought, str), f"{name}.reasoning", "must be a string")
        if content is None and calls:  # an assistant's turn may be calls alone
            content = ""
        check(isinstance(content, str), f"{name}.content", "must be a string or a list of text parts")
        answers = {}
        if role == "tool":  # the result of a call, named by its id
            answers["tool_call_id"] = get(message, "tool_call_id", str, None, prefix=f"{name}.")
            check(answers["tool_call_id"] is not None, f"{name}.tool_call_id", "is required in a tool message: the id of the call it answers")
            answers["name"] = get(message, "name", str, None, prefix=f"{name}.")
        out.append(ChatMessage("system" if role == "developer" else role, content, tool_calls=calls, **answers,
                               reasoning=thought if role == "assistant" else None))
    return tuple(out)


def tool_calls(message: dict, name: str) -> tuple[ToolCall, ...]:
    """An assistant message's tool_calls, in OpenAI's shape: [{"id", "type": "function", "function":
    {"name", "arguments": JSON text}}]."""
    calls = get(message, "tool_calls", list, [], prefix=f"{name}.")
    out = []
    for j, call in enumerate(calls):
        where = f"{name}.tool_calls[{j}]"
        check(isinstance(call, dict), where, "must be an object {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}")
        check(get(call, "type", str, "function", prefix=f"{where}.") == "function", f"{where}.type", "must be \"function\"")
        call_id = get(call, "id", str, None, prefix=f"{where}.")
        check(call_id is not None, f"{where}.id", "is required (a string)")
        function = get(call, "function", dict, None, prefix=f"{where}.")
        check(function is not None, f"{where}.function", "is required: {\"name\", \"arguments\"}")
        function_name = get(function, "name", str, "", prefix=f"{where}.function.")
        check(bool(function_name), f"{where}.function.name", "is required (a non-empty string)")
        arguments = get(function, "arguments", str, "{}", prefix=f"{where}.function.")
        out.append(ToolCall(call_id, function_name, arguments))
    return tuple(out)


def template_kwargs(body: dict) -> str | None:
    """vLLM's chat_template_kwargs: an object whose members become variables of the chat template
    (their values any JSON), as the tokenizer gets them (JSON text); None when absent or empty."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return None
    check(isinstance(value, dict), "chat_template_kwargs", "must be an object of template variables (e.g. {\"enable_thinking\": false})")
    for name in sorted(value):
        if name in TEMPLATE_CALL:
            instead = f": send '{TEMPLATE_CALL[name]}', the request's own field" if TEMPLATE_CALL[name] else ""
            check(False, f"chat_template_kwargs.{name}", f"is set by the server's call of the chat template, not a variable "
                                                         f"a request may set{instead}")
    return json.dumps(value) if value else None
