"""Tools and tool calls in a chat prompt.

A template that knows tools (Qwen3's, Hermes', Llama 3.1's) gets them as `tools=` and renders the
history of calls itself, in the shape transformers documents and those templates read: an
assistant's `tool_calls: [{"id", "type": "function", "function": {"name", "arguments"}}]`, the
arguments as a dict (Qwen3's template takes a string too; Hermes' and Llama's need the dict), and
"tool" messages with their content, `tool_call_id` and `name`.

A template that does not (the bundled SmolLM2's ChatML ignores `tools`) is told apart by rendering
with and without tools: the same text. Its prompt then says it all in text, in the Hermes
convention the gateway reads calls back in (gateway/tool_parser.py): a system message (the first
one, or a new one before it) lists the functions' signatures as JSON inside <tools></tools> and
asks for calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call>; past calls are written
that way in their assistant's message, and results come back as <tool_response> in a user turn.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from jaxstream.protocol import ChatMessage, ToolCall

# apply(messages, tools) -> the template's text
Apply = Callable[[list[dict], list[dict] | None], str]
# A tool to tell whether a template renders tools, when a request has none but its history has calls
PROBE = [{"type": "function", "function": {"name": "probe", "description": "Tells whether the template renders tools.",
                                           "parameters": {"type": "object", "properties": {}}}}]


def render(apply: Apply, messages: tuple[ChatMessage, ...], tools: list[dict] | None) -> str:
    """The template's text for `messages` with `tools` (None: no tools offered)."""
    native = template_messages(messages)
    if not tools and not any(m.tool_calls or m.role == "tool" for m in messages):
        return apply(native, None)
    try:
        with_tools, without = apply(native, tools or PROBE), apply(native, None)
    except Exception:  # a template that refuses a "tool" role or tool_calls does not know them either
        with_tools = without = None
    if with_tools != without:
        return with_tools if tools else without
    return apply(described(native, tools), None)


def template_messages(messages: tuple[ChatMessage, ...]) -> list[dict]:
    out = []
    for m in messages:
        message = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments(c)}}
                                     for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def arguments(call: ToolCall) -> dict | str:
    """The call's arguments as a dict when they are a JSON object, else as the text they are."""
    try:
        value = json.loads(call.arguments)
    except (ValueError, RecursionError):
        return call.arguments
    return value if isinstance(value, dict) else call.arguments


def described(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages that say in text what a template without tools would leave out."""
    out: list[dict] = []
    for message in messages:
        if message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("responses"):  # results of one turn's calls: one user turn
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "responses": True})
            continue
        content = message["content"]
        calls = [call_text(c["function"]) for c in message.get("tool_calls", ())]
        out.append({"role": message["role"], "content": "\n".join(([content] if content else []) + calls)})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools:
        if out[0]["role"] == "system":
            out[0]["content"] += "\n\n" + tools_prompt(tools)
        else:
            out.insert(0, {"role": "system", "content": tools_prompt(tools)})
    return out


def call_text(function: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': function['name'], 'arguments': function['arguments']}, ensure_ascii=False)}\n</tool_call>"


def tools_prompt(tools: list[dict]) -> str:
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou can call functions to help answer the user. Their signatures are in <tools></tools>:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "To call a function, answer with a JSON object of its name and arguments inside <tool_call></tool_call> tags, "
            "one per call:\n<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\n</tool_call>")
