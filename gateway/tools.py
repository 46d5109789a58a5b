"""OpenAI's tools on chat completions: `tools`, `tool_choice`, `parallel_tool_calls`.

1. `tool_use(body)` reads and checks them into a ToolUse: the tools as the chat template gets them
   (GenerateRequest.tools; none with tool_choice "none", as vLLM's exclude_tools_when_tool_choice_none),
   and for a forced choice the constraint that makes the output a call (vLLM's): a named function's
   parameters schema, or for "required" an array of {"name", "parameters"} objects.
2. `constrained` puts that constraint in the request's SamplingParams (a 400 when another field
   constrains the output already: one output cannot follow two grammars).
3. Each choice's output is read for calls by a reader of its own (`reader`; gateway/tool_parser.py,
   and for "auto" the model family's syntax, model.tool_parser: gateway/tool_syntaxes.py), behind
   the reasoning reader where the model thinks (gateway/reasoning.py). finish_reason is OpenAI's,
   as vLLM gives it: "tool_calls" when an "auto" or "required" output stopped with calls, the
   engine's own for a named call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import msgspec

from gateway.errors import invalid
from gateway.fields import PARALLEL_TOOL_CALLS
from gateway.params import check, get, read
from gateway.tool_parser import ArrayCalls, Calls, NamedCall, new_call_id
from gateway.tool_syntaxes import AUTO_READERS, CALL_IDS, TYPED_READERS
from jaxstream.english import listed
from jaxstream.grammar import problem
from jaxstream.protocol import Constraint, FinishReason, SamplingParams

MAX_TOOLS = 128  # OpenAI's limit
CHOICES = ("none", "auto", "required")
NAMED_FORM = '{"type": "function", "function": {"name": ...}}'
NO_PARAMETERS = {"type": "object", "properties": {}}  # a function that takes none
# The fields that ask for a constraint of their own (gateway/params.py reads them)
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "regex", "json_schema", "ebnf", "structural_tag")


@dataclass(frozen=True)
class ToolUse:
    tools: tuple[dict, ...] = ()  # {"type": "function", "function": {"name", "description"?, "parameters"?}}
    choice: str = "none"  # "none", "auto", "required", or "named"
    name: str | None = None  # the named function
    parallel: bool = True  # parallel_tool_calls: false keeps one call
    constraint: Constraint | None = None  # a forced call's
    syntax: str = "hermes"  # how the model writes calls (model.tool_parser): gateway/tool_syntaxes.py

    def rendered(self) -> str | None:
        """GenerateRequest.tools: the tools the chat template shows the model (JSON text)."""
        return json.dumps(list(self.tools)) if self.tools and self.choice != "none" else None

    def constrained(self, sampling: SamplingParams, body: dict) -> SamplingParams:
        """The request's sampling with what the calls ask of the output: a forced call's constraint;
        for Mistral's "auto", its special tokens kept ([TOOL_CALLS] is one), as vLLM's adjust_request."""
        if self.syntax == "mistral" and self.choice == "auto":
            sampling = msgspec.structs.replace(sampling, skip_special_tokens=False)
        if self.constraint is None:
            return sampling
        if sampling.constraint is not None:
            others = [f"'{name}'" for name in CONSTRAINT_FIELDS if body.get(name) not in (None, {"type": "text"})]
            raise invalid(f"'tool_choice' forces a tool call, which fixes the output's shape, and {listed(others) or 'another field'} "
                          "asks for a shape too: one output follows one of them", "tool_choice")
        return msgspec.structs.replace(sampling, constraint=self.constraint)

    def reader(self) -> Calls | None:
        """A new reader of one choice's output, or None when no call is read (tool_choice "none")."""
        new_id = CALL_IDS.get(self.syntax, new_call_id)
        match self.choice:
            case "auto":
                typed = {"tools": self.tools} if self.syntax in TYPED_READERS else {}
                return AUTO_READERS[self.syntax](single=not self.parallel, new_id=new_id, **typed)
            case "required":
                return ArrayCalls(single=not self.parallel, new_id=new_id)
            case "named":
                return NamedCall(self.name, new_id=new_id)
        return None

    def finish_reason(self, finish: FinishReason | None, called: bool) -> str | None:
        reason = None if finish is None else finish.type
        return "tool_calls" if called and reason == "stop" and self.choice in ("auto", "required") else reason


def tool_use(body: dict, syntax: str = "hermes") -> ToolUse:
    """The request's tools; `syntax`: model.tool_parser, how the model writes a call."""
    tools = read_tools(body.get("tools"))
    parallel = read(body, PARALLEL_TOOL_CALLS)
    choice, name = read_choice(body.get("tool_choice"), tools)
    # Harmony's header comes before a call's arguments: a named call's is written in the prompt (the
    # tokenizer's, GenerateRequest.forced_call), while "required" would constrain the header itself
    check(syntax != "openai" or choice != "required", "tool_choice",
          "\"required\" is not served for a Harmony model (GPT-OSS) yet: name the function ({\"type\": \"function\", "
          "\"function\": {\"name\": ...}}), or send \"auto\"")
    if choice == "named":
        index = next(i for i, t in enumerate(tools) if t["function"]["name"] == name)
        schema = tools[index]["function"].get("parameters", NO_PARAMETERS)
        constraint = checked(Constraint("json_schema", json.dumps(schema)), f"tools[{index}].function.parameters")
    elif choice == "required":
        constraint = Constraint("json_schema", json.dumps(calls_schema(tools, parallel)))
        if problem(constraint) is not None:  # name the tool whose schema it is (each checked only then)
            for i, tool in enumerate(tools):
                checked(Constraint("json_schema", json.dumps(tool["function"].get("parameters", NO_PARAMETERS))),
                        f"tools[{i}].function.parameters")
            checked(constraint, "tool_choice")
    else:
        constraint = None
    return ToolUse(tools, choice, name, parallel, constraint, syntax)


def read_tools(value: object) -> tuple[dict, ...]:
    """OpenAI's tools array, each entry as the chat template gets it (only the fields it uses)."""
    if value is None:
        return ()
    check(isinstance(value, list), "tools", "must be an array of {\"type\": \"function\", \"function\": {...}} objects")
    check(len(value) <= MAX_TOOLS, "tools", f"takes at most {MAX_TOOLS} tools, got {len(value)}")
    tools, names = [], set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        check(isinstance(tool, dict), where, "must be an object")
        kind = get(tool, "type", str, "function", prefix=f"{where}.")
        check(kind == "function", f"{where}.type", "must be \"function\": the only kind of tool served")
        function = get(tool, "function", dict, None, prefix=f"{where}.")
        check(function is not None, f"{where}.function", "is required: an object with the function's name, description and parameters")
        name = get(function, "name", str, "", prefix=f"{where}.function.")
        check(bool(name), f"{where}.function.name", "is required (a non-empty string)")
        check(name not in names, f"{where}.function.name", "repeats an earlier tool's name: a call names one function")
        names.add(name)
        entry = {"name": name}
        if (description := get(function, "description", str, None, prefix=f"{where}.function.")) is not None:
            entry["description"] = description
        if (parameters := get(function, "parameters", dict, None, prefix=f"{where}.function.")) is not None:
            entry["parameters"] = parameters
        tools.append({"type": "function", "function": entry})
    return tuple(tools)


def read_choice(value: object, tools: tuple[dict, ...]) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function). Absent: "auto" with tools."""
    if value is None:
        return ("auto" if tools else "none"), None
    if isinstance(value, str):
        check(value in CHOICES, "tool_choice", f"must be \"none\", \"auto\", \"required\" or {NAMED_FORM}")
        choice, name = value, None
    else:
        check(isinstance(value, dict), "tool_choice", f"must be \"none\", \"auto\", \"required\" or {NAMED_FORM}")
        kind = get(value, "type", str, None, prefix="tool_choice.")
        check(kind == "function", "tool_choice.type", f"must be \"function\" ({NAMED_FORM}): the only kind of tool served")
        function = get(value, "function", dict, None, prefix="tool_choice.")
        check(function is not None, "tool_choice.function", "is required: {\"name\": ...}")
        name = get(function, "name", str, None, prefix="tool_choice.function.")
        check(bool(name), "tool_choice.function.name", "is required (a non-empty string)")
        choice = "named"
    if choice in ("required", "named"):
        check(bool(tools), "tool_choice", "forces a tool call, and needs 'tools' to choose from")
    if choice == "named":
        check(any(t["function"]["name"] == name for t in tools), "tool_choice.function.name", "names no function of 'tools'")
    return ("none" if choice == "auto" and not tools else choice), name


def calls_schema(tools: tuple[dict, ...], parallel: bool) -> dict:
    """vLLM's schema for tool_choice "required": an array of at least one call, each an object
    {"name": <one tool's name>, "parameters": <that tool's schema>}. Definitions each schema refers
    to by "#/$defs/..." move to the root, where the refs now point."""
    calls, definitions = [], {}
    for i, tool in enumerate(tools):
        parameters = dict(tool["function"].get("parameters", NO_PARAMETERS))
        for key in ("$defs", "definitions"):
            for name, schema in (parameters.pop(key, None) or {}).items():
                check(definitions.setdefault((key, name), schema) == schema, f"tools[{i}].function.parameters",
                      f"defines {key}/{name} differently from an earlier tool: with tool_choice \"required\" the tools' "
                      "definitions are shared")
        calls.append({"type": "object", "properties": {"name": {"type": "string", "const": tool["function"]["name"]},
                                                       "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    for (key, name), definition in definitions.items():
        schema.setdefault(key, {})[name] = definition
    return schema


def checked(constraint: Constraint, param: str) -> Constraint:
    """The constraint, or a 400 naming `param` with the grammar library's reason."""
    reason = problem(constraint)
    check(reason is None, param, f"is not a JSON schema a tool call can be constrained to: {reason}")
    return constraint
