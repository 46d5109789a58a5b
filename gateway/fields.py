"""The request fields the gateway reads: one row per field, from which gateway/params.py reads
requests and gateway/openapi.py writes `/openapi.json`'s bodies, so the two cannot drift.

A row names a field, the peers' other spellings of it (read in order after its own: the first one a
body gives wins; a flag is set by any), its JSON kinds, its range or choices, its default (SamplingParams' where the
value becomes one of its fields: the one place sampling defaults live), the bodies that carry it
and what it asks for. `params.read` reads a row: kind, spelling, range, default. A field whose
reading is its own (a prompt, messages, tools, the constraint dialects, bounds from server config)
names its reader in `reader`, and is here for the document: its kinds and, where they cannot say
it, its JSON Schema (`shape`).

To add a field: add a row below and to FIELDS. One that fills SamplingParams is then read by every
route whose body carries it; any other, read it where the route needs it (`params.read`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxstream.config import LOGPROBS_MODES
from jaxstream.protocol import CHAT_MAX_NEW_TOKENS, GENERATE_MAX_NEW_TOKENS, SamplingParams

DEFAULT = SamplingParams()  # the defaults of every sampling field (one place: the protocol's Struct)
# Token ids travel as int32 to the device: a larger id is in no vocabulary (and one past 2**64 could
# not even be encoded). The tokenizer checks the rest against the model's vocabulary.
MAX_TOKEN_ID = 2**31 - 1

# -- the bodies that carry fields
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
GENERATE = "/generate"  # its top level
SAMPLING_PARAMS = "/generate sampling_params"  # the object, or each one of a batch's list
STREAM_OPTIONS = "stream_options"  # chat's and completions'
SCORE = "/v1/score"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
ABORT = "/abort_request"
INFERENCE = "/inference/v1/generate"  # vLLM's tokens in, tokens out: its top level
INFERENCE_SAMPLING = "/inference/v1/generate sampling_params"  # vLLM's SamplingParams object
OPENAI = (CHAT, COMPLETIONS)
SAMPLED = (CHAT, COMPLETIONS, RESPONSES, SAMPLING_PARAMS, INFERENCE_SAMPLING)  # the bodies params.sampling_params reads

# -- JSON kinds (float: a number, an integer too)
NUMBER, INTEGER, FLAG, TEXT, ARRAY, OBJECT = (float,), (int,), (bool,), (str,), (list,), (dict,)


@dataclass(frozen=True)
class Field:
    """One request field, as the gateway reads it and the document lists it."""

    name: str
    kind: tuple[type, ...]  # its JSON kinds
    bodies: tuple[str, ...]  # the bodies that carry it
    says: str  # what it asks for, in one line
    aliases: tuple[str, ...] = ()  # the peers' other spellings, read in this order after `name`
    fills: str = ""  # the SamplingParams field its value becomes; its default is then that field's
    default: Any = None  # its value when no spelling is given
    # The range of its numbers: its value, or an array's items (an object's values)
    minimum: float | None = None
    maximum: float | None = None
    open_minimum: bool = False  # the minimum itself is refused
    sentinel: tuple[int, str] | None = None  # a value outside the range taken too, and what it means
    range_says: str = ""  # how a refusal states the range, where the bounds are not all of it
    choices: tuple[str, ...] = ()  # a string's values
    items: tuple[type, ...] = ()  # an array's items' kinds, an object's values'
    max_items: int | None = None  # the most items of an array (entries of an object), where fixed
    holds: str = ""  # an object whose fields are the rows of this body
    shape: dict | None = None  # its JSON Schema, where kinds and bounds cannot say it
    reader: str = ""  # what reads it where params.read alone does not: "module.function" (or Class.method) of gateway/
    required_in: tuple[str, ...] = ()  # the bodies that must give it

    def __post_init__(self) -> None:
        if self.fills:
            default = getattr(DEFAULT, self.fills)
            if self.default not in (None, default):
                raise ValueError(f"{self.name} fills SamplingParams.{self.fills}: its default is that field's, {default!r}")
            object.__setattr__(self, "default", default)

    @property
    def spellings(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


# -- JSON Schema of the fields whose nesting kinds cannot say
STR, OBJ = {"type": "string"}, {"type": "object"}
IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}}
ID_LISTS = {"oneOf": [IDS, {"type": "array", "items": IDS}]}  # one prompt's token ids, or a batch's


def obj(required: tuple[str, ...] = (), **properties: dict) -> dict:
    schema = {"type": "object", "properties": properties, "additionalProperties": True}
    return {**schema, "required": list(required)} if required else schema


TEXT_PART = obj(("type", "text"), type={"const": "text"}, text=STR)
MESSAGE = obj(("role",), role={"type": "string", "minLength": 1,  # OpenAI's roles, or any the chat template knows (as vLLM)
                                "examples": ["system", "user", "assistant", "developer", "tool"]},
              content={"oneOf": [STR, {"type": "array", "items": TEXT_PART}, {"type": "null"}]},
              tool_calls={"type": "array", "items": OBJ}, tool_call_id=STR, name=STR)
INPUT_PART = obj(("type", "text"), type={"type": "string", "enum": ["input_text", "output_text"]}, text=STR)
INPUT_ITEM = obj(("role", "content"), type={"const": "message"},
                 role={"type": "string", "enum": ["user", "system", "developer", "assistant"]},
                 content={"oneOf": [STR, {"type": "array", "items": INPUT_PART}]})

# -- the rows

ID = dict(minimum=0, maximum=MAX_TOKEN_ID)  # a token id's range
# Alternatives per token: at most server.max_logprobs, which gateway/logprob_counts.py checks (the
# route's reader), and -1 (the whole vocabulary) where vLLM takes it
TOP = dict(minimum=0)
ALL = dict(sentinel=(-1, "the whole vocabulary"))

# Sampling, read by params.sampling_params wherever SamplingParams is
TEMPERATURE = Field("temperature", NUMBER, SAMPLED, "Divides the logits before sampling; 0 samples greedily",
                    fills="temperature", minimum=0)
TOP_P = Field("top_p", NUMBER, SAMPLED, "Samples from the most likely tokens whose probabilities sum to top_p",
              fills="top_p", minimum=0, maximum=1, open_minimum=True)
TOP_K = Field("top_k", INTEGER, SAMPLED, "Samples from the k most likely tokens; -1 or 0: all", fills="top_k",
              **ID, sentinel=(-1, "off"))
MIN_P = Field("min_p", NUMBER, SAMPLED, "Drops tokens less likely than min_p times the most likely one", fills="min_p",
              minimum=0, maximum=1)
MIN_TOKENS = Field("min_tokens", INTEGER, SAMPLED, "Tokens generated before a stop token or string may end the output",
                   aliases=("min_new_tokens",), fills="min_new_tokens", minimum=0)
PRESENCE_PENALTY = Field("presence_penalty", NUMBER, SAMPLED, "Subtracted from the logit of every token already generated",
                         fills="presence_penalty", minimum=-2, maximum=2)
FREQUENCY_PENALTY = Field("frequency_penalty", NUMBER, SAMPLED, "Subtracted once per time a token was generated",
                          fills="frequency_penalty", minimum=-2, maximum=2)
REPETITION_PENALTY = Field("repetition_penalty", NUMBER, SAMPLED,
                           "Divides positive logits (multiplies negative ones) of prompt and output tokens; 1: off",
                           fills="repetition_penalty", minimum=0, maximum=2, open_minimum=True)
SEED = Field("seed", INTEGER, SAMPLED, "Makes sampling reproducible (the n samples get seed, seed + 1, ...)",
             aliases=("sampling_seed",), fills="seed")
IGNORE_EOS = Field("ignore_eos", FLAG, SAMPLED, "Generates past the end-of-sequence token", fills="ignore_eos")
SKIP_SPECIAL_TOKENS = Field("skip_special_tokens", FLAG, (*SAMPLED, DETOKENIZE), "Leaves special tokens out of the text",
                            fills="skip_special_tokens")
NO_STOP_TRIM = Field("no_stop_trim", FLAG, SAMPLED, "Keeps a matched stop string at the end of the text",
                     aliases=("include_stop_str_in_output",), fills="no_stop_trim")
STOP = Field("stop", (str, list), SAMPLED, "Strings that end the output (server.max_stop_strings of them at most)",
             items=TEXT, reader="params.stop_strings")
STOP_REGEX = Field("stop_regex", (str, list), SAMPLED, "Python regular expressions that end the output when one matches it",
                   items=TEXT, max_items=16, reader="params.stop_patterns")
STOP_TOKEN_IDS = Field("stop_token_ids", ARRAY, SAMPLED, "Token ids that end the output", items=INTEGER, **ID,
                       reader="params.int_list")
LOGIT_BIAS = Field("logit_bias", OBJECT, SAMPLED, "Added to the logits of tokens, by token id as a string",
                   items=NUMBER, minimum=-100, maximum=100, reader="params.logit_bias")
ALLOWED_TOKEN_IDS = Field("allowed_token_ids", ARRAY, SAMPLED, "The only token ids that may be sampled", items=INTEGER, **ID,
                          reader="params.allowed_token_ids")
LOGPROBS_MODE = Field("logprobs_mode", TEXT, (*SAMPLED, GENERATE),
                      "Which distribution logprobs come from; absent: the server's (server.logprobs_mode)",
                      choices=LOGPROBS_MODES, reader="params.sampling_params")
N = Field("n", INTEGER, (CHAT, COMPLETIONS, SAMPLING_PARAMS, INFERENCE_SAMPLING), "Samples per prompt", default=1, minimum=1,
          reader="params.choices_count")

# The most tokens to generate, each route's name and default
MAX_COMPLETION_TOKENS = Field("max_completion_tokens", INTEGER, (CHAT,),
                              "The most tokens to generate (read before max_tokens); absent: up to the context", minimum=1)
CHAT_MAX_TOKENS = Field("max_tokens", INTEGER, (CHAT,), "The most tokens to generate; absent: up to the context",
                        default=CHAT_MAX_NEW_TOKENS, minimum=1)
COMPLETION_MAX_TOKENS = Field("max_tokens", INTEGER, (COMPLETIONS,), "The most tokens to generate; 0 only with echo",
                              default=DEFAULT.max_new_tokens, minimum=0)
MAX_OUTPUT_TOKENS = Field("max_output_tokens", INTEGER, (RESPONSES,), "The most tokens to generate; absent: up to the context",
                          default=CHAT_MAX_NEW_TOKENS, minimum=1)
MAX_NEW_TOKENS = Field("max_new_tokens", INTEGER, (SAMPLING_PARAMS,), "The most tokens to generate; 0 runs the prompt alone",
                       default=GENERATE_MAX_NEW_TOKENS, minimum=0)

# What comes back
CHAT_LOGPROBS = Field("logprobs", FLAG, (CHAT,), "Returns each generated token's logprob", default=False)
COMPLETION_LOGPROBS = Field("logprobs", INTEGER, (COMPLETIONS,),
                            "Returns each token's logprob with this many alternatives (server.max_logprobs at most)", **TOP)
TOP_LOGPROBS = Field("top_logprobs", INTEGER, (CHAT, RESPONSES),
                     "Alternatives returned with each token's logprob (server.max_logprobs at most)", default=0, **TOP, **ALL)
PROMPT_LOGPROBS = Field("prompt_logprobs", INTEGER, (*OPENAI, INFERENCE_SAMPLING),
                        "Returns the prompt's logprobs with this many alternatives (server.max_logprobs at most)",
                        **TOP, **ALL, reader="params.prompt_logprobs_count")
RETURN_TOKENS_AS_TOKEN_IDS = Field("return_tokens_as_token_ids", FLAG, OPENAI, "Names logprobs' tokens as token_id:<id>",
                                   default=False)
RETURN_TOKEN_IDS = Field("return_token_ids", FLAG, OPENAI, "Returns the prompt's and each choice's token ids", default=False)
ECHO = Field("echo", FLAG, OPENAI, "Returns the prompt (chat: a continued assistant message) before the output", default=False)
RETURN_ROUTED_EXPERTS = Field("return_routed_experts", FLAG, (*OPENAI, GENERATE),
                              "Returns the MoE layers' chosen experts at every position", default=False)
ROUTED_EXPERTS_START_LEN = Field("routed_experts_start_len", INTEGER, (*OPENAI, GENERATE),
                                 "The first position whose routed experts return", default=0, minimum=0,
                                 range_says="within [0, prompt tokens]")
STREAM = Field("stream", FLAG, (*OPENAI, RESPONSES, GENERATE), "Answers with server-sent events as the output grows",
               default=False)
STREAM_OPTIONS_FIELD = Field("stream_options", OBJECT, OPENAI, "Options of a stream", holds=STREAM_OPTIONS,
                             reader="params.stream_flags")
INCLUDE_USAGE = Field("include_usage", FLAG, (STREAM_OPTIONS,), "A last chunk with the usage", default=False)
CONTINUOUS_USAGE_STATS = Field("continuous_usage_stats", FLAG, (STREAM_OPTIONS,), "The usage so far in every chunk (with include_usage)",
                               default=False)

# The prompt
MODEL = Field("model", TEXT, (*OPENAI, RESPONSES, SCORE, INFERENCE),
              "The served model's name (or \"default\"), or a loaded LoRA adapter's (vLLM's: an adapter is a model)",
              reader="openai_routes.OpenAIRoutes.check_model")
LORA_PATH = Field("lora_path", (str, list), (*OPENAI, RESPONSES, INFERENCE, GENERATE),
                  "A loaded LoRA adapter's name (SGLang's; on /generate a list of them, one per prompt; null: the base model)",
                  aliases=("lora_name",), shape={"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": ["string", "null"]}}]},
                  reader="adapters.Adapters.lora_paths")
MESSAGES = Field("messages", ARRAY, (CHAT, TOKENIZE), "The conversation", shape={"type": "array", "items": MESSAGE, "minItems": 1},
                 reader="messages.chat_messages", required_in=(CHAT,))
PROMPT = Field("prompt", (str, list), (COMPLETIONS,), "A text or token ids, or a list of either (one choice per prompt)",
               shape={"oneOf": [STR, {"type": "array", "items": STR}, *ID_LISTS["oneOf"]]},
               reader="openai_routes.completion_prompts", required_in=(COMPLETIONS,))
TRUNCATE_PROMPT_TOKENS = Field("truncate_prompt_tokens", INTEGER, OPENAI, "Keeps this many of the prompt's tokens; -1: as many as fit",
                               minimum=1, sentinel=(-1, ""))
TRUNCATION_SIDE = Field("truncation_side", TEXT, OPENAI, "Which end of a truncated prompt is kept: left truncates the start",
                        default="left", choices=("left", "right"))
ADD_GENERATION_PROMPT = Field("add_generation_prompt", FLAG, (CHAT, TOKENIZE), "Opens a new assistant turn after the messages")
CONTINUE_FINAL_MESSAGE = Field("continue_final_message", FLAG, (CHAT, TOKENIZE), "Leaves the last message open, to be continued")
TOOLS = Field("tools", ARRAY, (CHAT, TOKENIZE), "Functions the model may call", items=OBJECT, reader="tools.tool_use")
TOOL_CHOICE = Field("tool_choice", (str, dict), (CHAT,), "none, auto, required, or the function to call", reader="tools.read_choice")
CHAT_TEMPLATE_KWARGS = Field("chat_template_kwargs", OBJECT, (CHAT, RESPONSES, TOKENIZE),
                             "Extra variables of the chat template, e.g. {\"enable_thinking\": false}", reader="messages.template_kwargs")
PARALLEL_TOOL_CALLS = Field("parallel_tool_calls", FLAG, (CHAT, RESPONSES), "Allows more than one call in an answer", default=True)

# Structured output: one constraint per request (gateway/constraints.py)
CONSTRAINED = (*OPENAI, RESPONSES)
RESPONSE_FORMAT = Field("response_format", OBJECT, OPENAI, "OpenAI's output format: text, json_object or json_schema",
                        reader="constraints.response_format")
STRUCTURED_OUTPUTS = Field("structured_outputs", OBJECT, (*CONSTRAINED, INFERENCE_SAMPLING),
                           "vLLM's constraint: json, regex, choice, grammar or json_object",
                           reader="constraints.vllm_fields")
GUIDED_JSON = Field("guided_json", (str, dict), CONSTRAINED, "vLLM's JSON schema the output matches", reader="constraints.vllm_fields")
GUIDED_REGEX = Field("guided_regex", TEXT, CONSTRAINED, "vLLM's regular expression the output matches", reader="constraints.vllm_fields")
GUIDED_CHOICE = Field("guided_choice", ARRAY, CONSTRAINED, "vLLM's strings, one of which is the output", items=TEXT,
                      reader="constraints.vllm_fields")
GUIDED_GRAMMAR = Field("guided_grammar", TEXT, CONSTRAINED, "vLLM's grammar the output matches", reader="constraints.vllm_fields")
GUIDED_DECODING_BACKEND = Field("guided_decoding_backend", TEXT, CONSTRAINED, "vLLM's backend name; there is one here",
                                reader="constraints.vllm_fields")
JSON_SCHEMA = Field("json_schema", (str, dict), (*CONSTRAINED, SAMPLING_PARAMS), "SGLang's JSON schema (its JSON text) the output matches",
                    reader="constraints.sglang_fields")
REGEX = Field("regex", TEXT, (*CONSTRAINED, SAMPLING_PARAMS), "SGLang's regular expression the output matches",
              reader="constraints.sglang_fields")
EBNF = Field("ebnf", TEXT, (*CONSTRAINED, SAMPLING_PARAMS), "SGLang's EBNF grammar the output matches", reader="constraints.sglang_fields")

# The Responses API's own
INPUT = Field("input", (str, list), (RESPONSES,), "A user message, or message items",
              shape={"oneOf": [STR, {"type": "array", "items": INPUT_ITEM}]}, reader="responses_routes.input_messages",
              required_in=(RESPONSES,))
INSTRUCTIONS = Field("instructions", TEXT, (RESPONSES,), "A system message before the input")
PREVIOUS_RESPONSE_ID = Field("previous_response_id", TEXT, (RESPONSES,), "Continues the conversation of a stored response")
INCLUDE = Field("include", ARRAY, (RESPONSES,), "Extra output: message.output_text.logprobs", items=TEXT)
STORE = Field("store", FLAG, (RESPONSES,), "Keeps the response for previous_response_id", default=True)
METADATA = Field("metadata", OBJECT, (RESPONSES,), "String pairs returned with the response", items=TEXT,
                 max_items=16, reader="responses_routes.metadata_of")
RESPONSES_TEXT = Field("text", OBJECT, (RESPONSES,), "The output's format (text.format), as chat's response_format",
                       shape=obj(format=OBJ), reader="constraints.responses_constraint")
USER = Field("user", TEXT, (RESPONSES,), "The end user's id, returned with the response")
RESPONSES_TOOL_CHOICE = Field("tool_choice", TEXT, (RESPONSES,), "none or auto (no tools are served here)", default="auto",
                              choices=("none", "auto"))

# SGLang's /generate, at its top level
GENERATE_TEXT = Field("text", (str, list), (GENERATE,), "A prompt, or a batch of them", items=TEXT, reader="native_routes.native_prompts")
INPUT_IDS = Field("input_ids", ARRAY, (GENERATE,), "A prompt's token ids, or a batch's", shape=ID_LISTS,
                  reader="native_routes.native_prompts")
SAMPLING_PARAMS_FIELD = Field("sampling_params", (dict, list), (GENERATE,), "The sampling fields, or one object per prompt",
                              holds=SAMPLING_PARAMS, reader="native_routes.sampling_params_list")
RID = Field("rid", (str, list), (GENERATE,), "The request's id, or one per prompt", items=TEXT, reader="native_routes.request_ids")
RETURN_LOGPROB = Field("return_logprob", FLAG, (GENERATE,), "Returns logprobs in meta_info", default=False)
TOP_LOGPROBS_NUM = Field("top_logprobs_num", INTEGER, (GENERATE,), "Alternatives with each logprob (server.max_logprobs at most)",
                         default=0, **TOP)
LOGPROB_START_LEN = Field("logprob_start_len", INTEGER, (GENERATE,), "The first prompt position whose logprob returns",
                          default=-1, minimum=0, sentinel=(-1, "output only"))
RETURN_TEXT_IN_LOGPROBS = Field("return_text_in_logprobs", FLAG, (GENERATE,), "Each logprob with its token's text", default=False)
TOKEN_IDS_LOGPROB = Field("token_ids_logprob", ARRAY, (GENERATE,),
                          "Token ids whose logprobs return at every position: for every prompt, or a batch's list per prompt",
                          shape=ID_LISTS, reader="native_routes.ids_per_prompt")
CUSTOM_PARAMS = Field("custom_params", OBJECT, (SAMPLING_PARAMS,),
                      "Arguments of a custom logit processor: accepted as SGLang does, read by none here", reader="params.custom_params")

# vLLM's /inference/v1/generate, at its top level and in its sampling_params
TOKEN_IDS = Field("token_ids", ARRAY, (INFERENCE,), "The prompt's token ids", items=INTEGER, **ID, reader="params.token_ids",
                  required_in=(INFERENCE,))
INFERENCE_SAMPLING_FIELD = Field("sampling_params", OBJECT, (INFERENCE,), "vLLM's sampling parameters", holds=INFERENCE_SAMPLING,
                                 reader="tokens_routes.TokensRoutes.generate")
REQUEST_ID = Field("request_id", TEXT, (INFERENCE,), "The request's id, returned with the response")
INFERENCE_MAX_TOKENS = Field("max_tokens", INTEGER, (INFERENCE_SAMPLING,), "The most tokens to generate",
                             default=DEFAULT.max_new_tokens, minimum=1)
INFERENCE_LOGPROBS = Field("logprobs", INTEGER, (INFERENCE_SAMPLING,),
                           "Returns each generated token's logprob with this many alternatives (server.max_logprobs at most)",
                           **TOP, **ALL)

# The other routes that read a prompt
QUERY = Field("query", (str, list), (SCORE,), "The text, or token ids, before each item", items=INTEGER, **ID,
              reader="score_routes.item_prompts", required_in=(SCORE,))
ITEMS = Field("items", (str, list), (SCORE,), "Texts, or token id lists, each scored after the query",
              shape={"oneOf": [STR, {"type": "array", "items": STR}, {"type": "array", "items": IDS}]},
              reader="score_routes.item_prompts", required_in=(SCORE,))
LABEL_TOKEN_IDS = Field("label_token_ids", ARRAY, (SCORE,), "The token ids scored", items=INTEGER, **ID,
                        reader="params.token_ids_logprob", required_in=(SCORE,))
APPLY_SOFTMAX = Field("apply_softmax", FLAG, (SCORE,), "Normalizes the scores over the labels", default=False)
ITEM_FIRST = Field("item_first", FLAG, (SCORE,), "Puts each item before the query", default=False)
TOKENIZE_PROMPT = Field("prompt", (str, list), (TOKENIZE,), "A text, or a list of them", items=TEXT,
                        reader="admin_routes.AdminRoutes.tokenize")
ADD_SPECIAL_TOKENS = Field("add_special_tokens", FLAG, (TOKENIZE,), "Adds the tokenizer's special tokens (a text's default)")
RETURN_TOKEN_STRS = Field("return_token_strs", FLAG, (TOKENIZE,), "Returns each token's text", default=False)
TOKENS = Field("tokens", ARRAY, (DETOKENIZE,), "Token ids, or a list of such lists", shape=ID_LISTS,
               reader="admin_routes.AdminRoutes.detokenize", required_in=(DETOKENIZE,))
ABORT_RID = Field("rid", TEXT, (ABORT,), "The request to abort (or give abort_all)")
ABORT_ALL = Field("abort_all", FLAG, (ABORT,), "Aborts every request", default=False)

FIELDS = (
    TEMPERATURE, TOP_P, TOP_K, MIN_P, MIN_TOKENS, PRESENCE_PENALTY, FREQUENCY_PENALTY, REPETITION_PENALTY, SEED, IGNORE_EOS,
    SKIP_SPECIAL_TOKENS, NO_STOP_TRIM, STOP, STOP_REGEX, STOP_TOKEN_IDS, LOGIT_BIAS, ALLOWED_TOKEN_IDS, LOGPROBS_MODE, N,
    MAX_COMPLETION_TOKENS, CHAT_MAX_TOKENS, COMPLETION_MAX_TOKENS, MAX_OUTPUT_TOKENS, MAX_NEW_TOKENS,
    CHAT_LOGPROBS, COMPLETION_LOGPROBS, TOP_LOGPROBS, PROMPT_LOGPROBS, RETURN_TOKENS_AS_TOKEN_IDS, RETURN_TOKEN_IDS, ECHO,
    RETURN_ROUTED_EXPERTS, ROUTED_EXPERTS_START_LEN, STREAM, STREAM_OPTIONS_FIELD, INCLUDE_USAGE, CONTINUOUS_USAGE_STATS,
    MODEL, LORA_PATH, MESSAGES, PROMPT, TRUNCATE_PROMPT_TOKENS, TRUNCATION_SIDE, ADD_GENERATION_PROMPT, CONTINUE_FINAL_MESSAGE, TOOLS,
    TOOL_CHOICE, PARALLEL_TOOL_CALLS, CHAT_TEMPLATE_KWARGS,
    RESPONSE_FORMAT, STRUCTURED_OUTPUTS, GUIDED_JSON, GUIDED_REGEX, GUIDED_CHOICE, GUIDED_GRAMMAR, GUIDED_DECODING_BACKEND,
    JSON_SCHEMA, REGEX, EBNF,
    INPUT, INSTRUCTIONS, PREVIOUS_RESPONSE_ID, INCLUDE, STORE, METADATA, RESPONSES_TEXT, USER, RESPONSES_TOOL_CHOICE,
    GENERATE_TEXT, INPUT_IDS, SAMPLING_PARAMS_FIELD, RID, RETURN_LOGPROB, TOP_LOGPROBS_NUM, LOGPROB_START_LEN,
    RETURN_TEXT_IN_LOGPROBS, TOKEN_IDS_LOGPROB, CUSTOM_PARAMS,
    TOKEN_IDS, INFERENCE_SAMPLING_FIELD, REQUEST_ID, INFERENCE_MAX_TOKENS, INFERENCE_LOGPROBS,
    QUERY, ITEMS, LABEL_TOKEN_IDS, APPLY_SOFTMAX, ITEM_FIRST, TOKENIZE_PROMPT, ADD_SPECIAL_TOKENS, RETURN_TOKEN_STRS, TOKENS,
    ABORT_RID, ABORT_ALL,
)
