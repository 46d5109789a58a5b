"""Turning a client request into token ids, and refusing what cannot run. Pure: no I/O.

One call per message of the tokenizer stream: a GenerateRequest becomes a TokenizedRequest for the
scheduler; a TokenizeRequest or DetokenizeRequest (/tokenize, /detokenize) a TokenizeReply for its
gateway; anything invalid a RequestRejected (400) for its gateway.
"""

from __future__ import annotations

import json

from jaxstream.config import ServerConfig
from jaxstream.english import counted, listed
from jaxstream.model_files import TokenizerInfo
from jaxstream.protocol import (
    MAX_BANNED_TOKENS,
    ChatMessage,
    DetokenizeRequest,
    FinishRule,
    GenerateRequest,
    RequestRejected,
    SamplingParams,
    TokenizedRequest,
    TokenizeReply,
    TokenizeRequest,
    TokenizerFacts,
)
from jaxstream.prompt_limit import CONTEXT_LENGTH_EXCEEDED, overflow, too_long
from tokenizer_svc import tool_prompt
from tokenizer_svc.harmony_prompt import HarmonyPrompt, Refused

Reply = TokenizedRequest | TokenizeReply | RequestRejected
EMPTY_PROMPT = "The decoder prompt cannot be empty: the prompt has no token"  # vLLM's words, which its clients match


class Preprocessor:
    """Called from several threads at once (tokenizer_svc/lanes.py): it holds no state of a request."""

    def __init__(self, info: TokenizerInfo, max_model_len: int | None,
                 chars_per_token: int = ServerConfig.max_chars_per_token, harmony: HarmonyPrompt | None = None) -> None:
        self.info = info
        self.harmony = harmony  # a Harmony model (GPT-OSS): chats rendered by openai-harmony, not the chat template
        self.tokenizer = info.tokenizer
        self.max_model_len = max_model_len or info.context_length
        self.chars_per_token = chars_per_token  # server.max_chars_per_token: jaxstream/prompt_limit.py

    def __call__(self, req: GenerateRequest | TokenizeRequest | DetokenizeRequest) -> Reply:
        try:
            match req:
                case GenerateRequest():
                    return self.check(req, self.token_ids(req))
                case TokenizeRequest():
                    return self.tokenize(req)
                case DetokenizeRequest():
                    return self.detokenize(req)
        except _Invalid as bad:
            return RequestRejected(req.rid, 400, bad.message, bad.param, bad.code)
        raise TypeError(f"not a tokenizer message: {type(req).__name__}")

    def model_facts(self) -> TokenizerFacts:
        """What the gateway needs to know of the model and only the tokenizer knows (heartbeat stats)."""
        return TokenizerFacts(max_model_len=self.max_model_len, vocab_size=self.info.vocab_size,
                              eos_token_ids=tuple(self.info.eos_token_ids),
                              bos_token_id=getattr(self.tokenizer, "bos_token_id", None),
                              has_chat_template=bool(getattr(self.tokenizer, "chat_template", None)) or self.harmony is not None)

    # -- generate

    def token_ids(self, req: GenerateRequest) -> list[int]:
        return self.truncated(self.prompt_ids(req), req.truncate_prompt_tokens, req.truncate_left)

    def prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.input_ids is not None:
            return list(req.input_ids)
        if req.messages is not None:
            if self.harmony is not None:
                return self.render_harmony(req)
            text = self.render(req.messages, req.add_generation_prompt, req.continue_final_message, req.tools,
                               req.chat_template_kwargs)
            self.check_chars(text, req, "messages")
            return self.encode(text, add_special_tokens=False)
        if not req.text:
            raise _Invalid(EMPTY_PROMPT, "prompt")
        self.check_chars(req.text, req, "prompt")  # the gateway refuses most such prompts: this is for one it let by
        return self.encode(req.text, add_special_tokens=req.add_special_tokens)

    def check_chars(self, text: str, req: GenerateRequest, param: str) -> None:
        """A prompt whose characters no context can hold is refused before it is tokenized (the
        encoding is what costs); one that asks to be truncated keeps what fits instead."""
        if req.truncate_prompt_tokens is None and (why := too_long(len(text), self.max_model_len, self.chars_per_token)):
            raise _Invalid(why, param, CONTEXT_LENGTH_EXCEEDED)

    def longest_entry(self) -> int:
        """The longest vocabulary entry (added tokens included), in the vocabulary's own spelling:
        for a byte-level BPE its bytes, at least its characters. server.max_chars_per_token is safe
        while it is not below this (jaxstream/config/server.py)."""
        added = [getattr(t, "content", str(t)) for t in getattr(self.tokenizer, "added_tokens_decoder", {}).values()]
        return max(map(len, [*self.tokenizer.get_vocab(), *added]), default=0)

    def truncated(self, ids: list[int], keep: int | None, left: bool = True) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: as many as the context
        holds), so a long prompt loses its beginning rather than being refused; its first ones when
        not `left` (vLLM's truncation_side "right")."""
        if keep is None:
            return ids
        if keep > self.max_model_len:
            raise _Invalid(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({self.max_model_len}). "
                           "Please request a smaller truncation size.", "truncate_prompt_tokens")
        keep = self.max_model_len if keep == -1 else keep
        return ids[-keep:] if left else ids[:keep]

    def check(self, req: GenerateRequest, ids: list[int]) -> TokenizedRequest:
        if not ids:
            raise _Invalid(EMPTY_PROMPT, "prompt")
        self.check_ids(ids, "prompt")
        sampling = req.sampling
        wanted = sampling.max_new_tokens
        # In the words of the request's engine, which its clients match (jaxstream/prompt_limit.py)
        limit, n = self.max_model_len, len(ids)
        room = limit - n
        name = req.max_tokens_name  # as the client spelled it: max_tokens, max_completion_tokens, sampling_params.max_new_tokens, ...
        if room < (wanted != 0):  # a prefill-only request (max_new_tokens 0) may fill the context: it scores it
            raise _Invalid(overflow(limit, n, None, name), "prompt", CONTEXT_LENGTH_EXCEEDED)
        if wanted is not None and wanted > room:
            raise _Invalid(overflow(limit, n, wanted, name), name, CONTEXT_LENGTH_EXCEEDED)
        self.check_ids([i for i, _ in sampling.logit_bias], "logit_bias")
        self.check_ids(sampling.stop_token_ids, "stop_token_ids")
        self.check_ids(sampling.allowed_token_ids, "allowed_token_ids")
        self.check_ids(sampling.token_ids_logprob, "token_ids_logprob")
        if sampling.prompt_logprobs_from >= len(ids):
            raise _Invalid(f"prompt logprobs from position {sampling.prompt_logprobs_from} asked, but the prompt "
                           f"has {counted(len(ids), 'token')} (positions 0..{len(ids) - 1})", "logprob_start_len")
        if sampling.return_routed_experts and sampling.routed_experts_start_len > len(ids):
            raise _Invalid(f"routed_experts_start_len {sampling.routed_experts_start_len} must be within [0, prompt tokens], and "
                           f"the prompt has {counted(len(ids), 'token')}", "routed_experts_start_len")
        # a Harmony chat's turn ends at <|return|> or <|call|>, whatever ignore_eos says (vLLM adds them alike)
        turn_ends = self.harmony.stop_ids() if self.harmony is not None and req.messages is not None else ()
        return TokenizedRequest(req.rid, req.gateway, tuple(ids), sampling, finish=self.finish_rule(sampling, room, turn_ends))

    def finish_rule(self, sampling: SamplingParams, room: int, turn_ends: tuple[int, ...] = ()) -> FinishRule:
        """The request's finish rule, resolved once: EOS joins the stop tokens unless ignore_eos (a
        Harmony chat's `turn_ends` always), and max_new_tokens is the room the context leaves when the
        client set none."""
        stop_ids = sampling.stop_token_ids + turn_ends + (() if sampling.ignore_eos else self.info.eos_token_ids)
        stop_ids = tuple(dict.fromkeys(stop_ids))
        if sampling.min_new_tokens > 1 and len(stop_ids) > MAX_BANNED_TOKENS:
            raise _Invalid(f"with min_tokens, at most {MAX_BANNED_TOKENS} stop token ids (EOS included) can be held "
                           f"back; got {len(stop_ids)}", "stop_token_ids")
        allowed = sampling.allowed_token_ids
        if sampling.min_new_tokens > 0 and allowed and set(allowed) <= set(stop_ids):
            raise _Invalid("every id of allowed_token_ids is a stop token (EOS included), which min_tokens holds back: "
                           "no token could be sampled", "allowed_token_ids")
        wanted = sampling.max_new_tokens
        return FinishRule(stop_ids, room if wanted is None else wanted, sampling.min_new_tokens)

    # -- /tokenize, /detokenize

    def tokenize(self, req: TokenizeRequest) -> TokenizeReply:
        if req.messages is not None and self.harmony is not None:
            ids = self.render_harmony(req)
        elif req.messages is not None:
            # The template writes its own special tokens, as for generation: the ids are the prompt
            # /generate would run for the same messages (add_special_tokens concerns `text`).
            text = self.render(req.messages, req.add_generation_prompt, req.continue_final_message, req.tools,
                               req.chat_template_kwargs)
            ids = self.encode(text, add_special_tokens=False)
        elif req.text is not None:
            ids = self.encode(req.text, add_special_tokens=req.add_special_tokens)
        else:
            raise _Invalid("give `text` or `messages` to tokenize", "text")
        strs = tuple(self.tokenizer.convert_ids_to_tokens(ids)) if req.token_strs else None
        return TokenizeReply(req.rid, token_ids=tuple(ids), token_strs=strs, max_model_len=self.max_model_len)

    def detokenize(self, req: DetokenizeRequest) -> TokenizeReply:
        ids = list(req.token_ids)
        self.check_ids(ids, "tokens")
        # No clean-up of spaces, as the detokenizer streams it: the text generation would have given.
        text = self.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens, clean_up_tokenization_spaces=False)
        return TokenizeReply(req.rid, token_ids=tuple(ids), text=text, max_model_len=self.max_model_len)

    # -- shared

    def render(self, messages: tuple[ChatMessage, ...], add_generation_prompt: bool, continue_final_message: bool = False,
               tools: str | None = None, template_kwargs: str | None = None) -> str:
        """The chat template's text. continue_final_message leaves the last message open (no
        end-of-turn after it), so the model continues it: an assistant's prefill. `tools`: OpenAI's
        tools array (JSON text), rendered by the template or described for it (tool_prompt.py).
        `template_kwargs`: vLLM's chat_template_kwargs (a JSON object's text), extra variables the
        template reads (Qwen3's enable_thinking); the gateway refused the names set here."""
        if not messages:
            raise _Invalid("messages must not be empty", "messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise _Invalid("this model has no chat template: send a text prompt instead of messages", "messages")
        try:
            offered = None if tools is None else json.loads(tools)
        except ValueError:
            raise _Invalid("tools must be a JSON array of tools", "tools") from None
        try:
            extra = {} if template_kwargs is None else json.loads(template_kwargs)
        except ValueError:
            extra = None
        if not isinstance(extra, dict):
            raise _Invalid("chat_template_kwargs must be a JSON object", "chat_template_kwargs")

        def apply(dicts: list[dict], tools: list[dict] | None) -> str:
            return self.tokenizer.apply_chat_template(dicts, tools=tools, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message, tokenize=False, **extra)

        try:
            return tool_prompt.render(apply, messages, offered)
        except Exception as exc:  # the template's own raise_exception (jinja2 TemplateError), or a bad role
            raise _Invalid(f"the chat template rejected these messages: {exc}", "messages") from None

    def render_harmony(self, req: GenerateRequest | TokenizeRequest) -> list[int]:
        """A Harmony model's chat as ids (harmony_prompt.py); a 400 naming the field it refuses."""
        if not req.messages:
            raise _Invalid("messages must not be empty", "messages")
        try:
            return self.harmony.render(req.messages, req.add_generation_prompt, req.continue_final_message, req.tools,
                                       req.chat_template_kwargs, getattr(req, "forced_call", None))
        except Refused as refused:
            raise _Invalid(refused.message, refused.param) from None
        except (ValueError, RuntimeError) as exc:  # openai_harmony.HarmonyError (a RuntimeError): e.g. a tool's schema it cannot write
            raise _Invalid(f"openai-harmony could not render these messages: {exc}", "messages") from None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_ids(self, ids: list[int] | tuple[int, ...], param: str) -> None:
        """Every id of a prompt, or of a sampling field that names tokens, in the vocabulary; the
        message names each id that is not (the first few of many) and the vocabulary's size."""
        vocab = self.info.vocab_size
        bad = sorted({i for i in ids if not 0 <= i < vocab})
        if bad:
            ids_are = f"token id {bad[0]} is" if len(bad) == 1 else f"token ids {listed(bad)} are"
            raise _Invalid(f"{param}: {ids_are} out of vocabulary (vocabulary size {vocab}: ids must be in 0..{vocab - 1})",
                           param)


class _Invalid(Exception):
    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        self.message, self.param, self.code = message, param, code
