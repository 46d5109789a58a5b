"""A chat of a Harmony model (GPT-OSS; model.tool_parser "openai") rendered to prompt ids with
openai-harmony, as vLLM renders gpt-oss's chat completions (serving_chat's harmony request, its
harmony_utils): not by the checkpoint's Jinja template, whose text the format's own renderer makes
exactly.

The conversation, in order:
- a system message: the model's identity (chat_template_kwargs `model_identity`, else Harmony's),
  the reasoning effort (the request's `reasoning_effort`, which the gateway passes here in
  chat_template_kwargs as gpt-oss's template takes it; else Harmony's default, medium) and today's
  date (UTC), as vLLM's;
- a developer message: the client's first system (or developer) message as its instructions, and
  the tools offered as the `functions` namespace. Any later system message is a developer message
  of its own, in its place;
- user messages as written; an assistant's `reasoning` sent back on the analysis channel, then its
  text on the final channel, or its tool calls each on the commentary channel to=functions.NAME
  (content type json) after its text, which is then a preamble on the commentary channel. As
  OpenAI's guide for Harmony says, the thinking before the last answer on the final channel is
  dropped (that of the calls since, which the model reads on, is kept); a tool's result from functions.NAME (its `name`, else the
  name of the call its tool_call_id answers) to the assistant, on the commentary channel;
- then `<|start|>assistant` (add_generation_prompt), for the model to answer; with a named
  tool_choice (GenerateRequest.forced_call), that call's header after it
  (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`), so the output is the
  call's arguments, which the request's constraint holds to the tool's schema.
An assistant message cannot be continued (continue_final_message) and roles beyond these are
refused: each a 400 naming the field.
The assistant's turn ends with `<|return|>` or `<|call|>` (stop_ids), which join its stop tokens.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from jaxstream.english import listed
from jaxstream.protocol import ChatMessage

ROLES = ("system", "user", "assistant", "tool")  # ChatMessage's ("developer" arrives as "system": gateway/messages.py)
EFFORTS = ("low", "medium", "high")


class Refused(Exception):
    def __init__(self, message: str, param: str) -> None:
        self.message, self.param = message, param


class HarmonyPrompt:
    def __init__(self, encoding: Any) -> None:
        self.encoding = encoding

    def stop_ids(self) -> tuple[int, ...]:
        """The tokens that end an assistant's turn: `<|return|>` (its answer) and `<|call|>` (a call)."""
        return tuple(sorted(self.encoding.stop_tokens_for_assistant_actions()))  # a set: in a fixed order

    def render(self, messages: tuple[ChatMessage, ...], add_generation_prompt: bool, continue_final_message: bool,
               tools: str | None, template_kwargs: str | None, forced_call: str | None = None) -> list[int]:
        """`forced_call`: a named tool_choice's function, whose call's header ends the prompt."""
        from openai_harmony import Conversation, Role

        if continue_final_message:
            raise Refused("continue_final_message is not served for a Harmony model (GPT-OSS): its answer is a message "
                          "of the final channel, which the renderer closes", "continue_final_message")
        if forced_call is not None and not add_generation_prompt:
            raise Refused("add_generation_prompt false leaves no assistant turn for the call tool_choice forces",
                          "add_generation_prompt")
        extra = json.loads(template_kwargs) if template_kwargs else {}
        offered = json.loads(tools) if tools else []
        conversation = Conversation.from_messages([self._system(extra), *self._messages(messages, offered)])
        if not add_generation_prompt:
            return self.encoding.render_conversation(conversation)
        ids = self.encoding.render_conversation_for_completion(conversation, Role.ASSISTANT)
        if forced_call is None:
            return ids
        # the call's header as gpt-oss writes it: what follows is the arguments, held to the tool's schema
        header = f"<|channel|>commentary to=functions.{forced_call} <|constrain|>json<|message|>"
        return ids + self.encoding.encode(header, allowed_special={"<|channel|>", "<|constrain|>", "<|message|>"})

    @staticmethod
    def _system(extra: dict) -> Any:
        from openai_harmony import Message, ReasoningEffort, Role, SystemContent

        content = SystemContent.new().with_conversation_start_date(datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"))
        effort = extra.get("reasoning_effort")
        if effort is not None:
            if effort not in EFFORTS:
                raise Refused(f"reasoning_effort must be \"low\", \"medium\" or \"high\" for a Harmony model, got {effort!r}",
                              "reasoning_effort")
            content = content.with_reasoning_effort(ReasoningEffort(effort.capitalize()))
        if (identity := extra.get("model_identity")) is not None:
            if not isinstance(identity, str):
                raise Refused("chat_template_kwargs.model_identity must be a string", "chat_template_kwargs.model_identity")
            content = content.with_model_identity(identity)
        return Message.from_role_and_content(Role.SYSTEM, content)

    def _messages(self, messages: tuple[ChatMessage, ...], tools: list[dict]) -> list[Any]:
        from openai_harmony import Author, Message, Role, ToolDescription

        functions = [ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                         parameters=t["function"].get("parameters")) for t in tools]
        instructed = any(m.role == "system" for m in messages)
        out: list[Any] = [] if instructed else [self._developer("", functions)] if functions else []
        names = {call.id: call.name for m in messages for call in m.tool_calls}  # a tool result names its function by its call
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if m.role not in ROLES:
                raise Refused(f"a Harmony model's chat takes {listed(['system', 'developer', *ROLES[1:]])} messages, "
                              f"not {m.role!r}", f"{where}.role")
            if m.role == "system":
                out.append(self._developer(m.content, functions if instructed else []))
                instructed = False  # the tools go with the first one
            elif m.role == "user":
                out.append(Message.from_role_and_content(Role.USER, m.content))
            elif m.role == "tool":
                name = m.name or names.get(m.tool_call_id or "")
                if not name:
                    raise Refused(f"{where}.tool_call_id names no call of an earlier assistant message, and the message has "
                                  "no 'name': a Harmony model is told which function answered", f"{where}.tool_call_id")
                out.append(Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), m.content)
                           .with_channel("commentary").with_recipient("assistant"))
            elif m.tool_calls:
                if m.reasoning:  # the thinking that led to the calls, which the model reads on
                    out.append(Message.from_role_and_content(Role.ASSISTANT, m.reasoning).with_channel("analysis"))
                if m.content:  # the text before its calls: a preamble the client was shown
                    out.append(Message.from_role_and_content(Role.ASSISTANT, m.content).with_channel("commentary"))
                out += [Message.from_role_and_content(Role.ASSISTANT, call.arguments).with_channel("commentary")
                        .with_recipient(f"functions.{call.name}").with_content_type("json") for call in m.tool_calls]
            else:
                if m.reasoning:
                    out.append(Message.from_role_and_content(Role.ASSISTANT, m.reasoning).with_channel("analysis"))
                if m.content:
                    out.append(Message.from_role_and_content(Role.ASSISTANT, m.content).with_channel("final"))
        # OpenAI's rule for Harmony: the thinking before an answer on the final channel is dropped once answered
        last_final = max((i for i, msg in enumerate(out) if msg.channel == "final"), default=-1)
        return [msg for i, msg in enumerate(out) if not (i < last_final and msg.channel == "analysis")]

    @staticmethod
    def _developer(instructions: str, functions: list[Any]) -> Any:
        from openai_harmony import DeveloperContent, Message, Role

        content = DeveloperContent.new()
        if instructions:
            content = content.with_instructions(instructions)
        if functions:
            content = content.with_function_tools(functions)
        return Message.from_role_and_content(Role.DEVELOPER, content)
