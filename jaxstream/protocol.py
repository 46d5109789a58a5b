"""The wire contract: every message that crosses a Redis stream, and nothing else.

Rules (see docs/style.md 1-2):
- This module imports only msgspec and the standard library.
- Every message is a frozen, tagged Struct; each stream carries exactly one union, decoded by one
  typed decoder (`decoder(UNION)`) and dispatched with `match`.
- Evolve like protobuf: new fields go last and have defaults; a field is never retyped or removed.
  A field that a later one supersedes keeps its place with a default, marked "up to version N":
  senders leave it at its default and only the struct's own accessor reads it, for an older sender.
  Bump PROTOCOL_VERSION when a field is added; tests decode messages of the previous version.
- Arrays travel as `Array`: raw little-endian bytes with dtype and shape. Nothing is pickled.

Streams and their unions (names built in `jaxstream.transport.Keys`); a stream marked (r) exists
once per data-parallel replica r, a scheduler+worker pair:

    tokenizer     gateway -> tokenizer_svc                   TokenizerInput  = GenerateRequest | TokenizeRequest | DetokenizeRequest
    scheduler(r)  tokenizer/gateway/detok -> scheduler r     SchedulerInput  = TokenizedRequest | AbortRequests | StopRequests | FlushCache
                                                                               | PauseGeneration | ContinueGeneration | UpdateWeights | Memory
                                                                               | WriteStats
    worker(r)     scheduler r -> worker r                    WorkerInput     = Step | UpdateWeights | Memory
    results(r)    worker r -> scheduler r AND detokenizers   WorkerOutput    = StepResult | ControlReply   (a group each)
    detok.D       schedulers -> detokenizer D                DetokenizerInput = RequestEvents
    gateway.G     tokenizer/scheduler/detok -> gateway G     GatewayInput  = OutputBatch | RequestRejected | TokenizeReply | FlushCacheReply
                                                                             | ControlReply

Control (version 7): the gateway asks every replica's scheduler; a scheduler relays what concerns
the device (UpdateWeights, Memory) to its worker in step order, and every answer is a ControlReply
to the asking gateway (a worker's goes through its scheduler, which acts on it first).
"""

from __future__ import annotations

import msgspec

# 2: penalties, logit bias, top and prompt logprobs, (de)tokenize, abort all; 3: replicas; 4: prefix cache;
# 5: overlap (StepSeq.slot, follows); 6: FinishRule, sampling sent once per request (with its slot);
# 7: weight updates, weight versions, pause / continue, memory release; 8: GenerateRequest.max_tokens_name;
# 9: routed experts (SamplingParams.return_routed_experts, StepResult.experts, RequestStart.routed_experts_from,
# RequestOutput.routed_experts); 10: token_ids_logprob, stop_regex, prompt ids and ranks back, prompt truncation
# and chat continuation (peer API conformance); 11: constrained decoding (SamplingParams.constraint), tools in chat
# (GenerateRequest.tools, ChatMessage's tool fields); 12: WriteStats (gauges current when a client reads them);
# 13: speculative decoding (StepSeq.drafts; a StepResult's rid repeats for a verified draft's tokens)
PROTOCOL_VERSION = 13


class Array(msgspec.Struct, frozen=True, array_like=True):
    """An n-d array as raw little-endian bytes. Convert with `jaxstream.arrays`."""

    dtype: str  # numpy dtype string, e.g. "<i4"
    shape: tuple[int, ...]
    data: bytes


# ---------------------------------------------------------------------------------------------
# Request description, shared by several messages


# max_new_tokens when a client gives none, as each API documents it: OpenAI's completions 16
# (SamplingParams' own default), its chat completions up to the context length, SGLang's /generate 128.
CHAT_MAX_NEW_TOKENS: int | None = None
GENERATE_MAX_NEW_TOKENS = 128


class Constraint(msgspec.Struct, frozen=True, array_like=True):
    """What the output must match (constrained decoding, version 11): every sampled token keeps the
    output a prefix of a match, and the request's end-of-sequence token is allowed only once it is
    a whole one. The gateway reads the client's fields into one (jaxstream/grammar.py checks it);
    the worker turns it into a token mask per step."""

    kind: str  # "json_schema" (spec: the schema as JSON text), "regex", "lark" (a Lark grammar)
    spec: str


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the client asked for. Validated by the gateway; every field's default is here (the
    gateway's routes read them from here), and they are OpenAI's."""

    max_new_tokens: int | None = 16  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0
    skip_special_tokens: bool = True
    # -- version 2
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted once per time the token was generated
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids unique
    top_logprobs: int = 0  # most likely alternatives returned with each generated token, 0..MAX_TOP_LOGPROBS
    # Prompt logprobs: -1 none; k >= 0: the logprob of every prompt token at position >= k, with
    # `top_logprobs` alternatives each. Position 0 is predicted by nothing: its logprob is NaN.
    prompt_logprobs_from: int = -1
    # Logprobs of the model's raw logits (temperature 1, no penalty or bias) instead of the default:
    # the distribution that sampled, after penalties, bias and temperature, before top-k/top-p/min-p.
    raw_logprobs: bool = False
    # The detokenizer attaches each returned token's own text to its logprobs.
    logprob_texts: bool = False
    no_stop_trim: bool = False  # keep a matched stop string at the end of the text (SGLang's no_stop_trim)
    # Logprobs of the fully processed distribution: the default's, then cut by top-k/top-p/min-p
    # (and min_tokens' ban) and renormalized over the tokens kept (vLLM's processed_logprobs).
    # Generated tokens only: a prompt token was not sampled, so it keeps the default's.
    processed_logprobs: bool = False
    # -- version 6
    # vLLM's allowed_token_ids: only these ids may be sampled, as if every other token had a logit
    # bias of -inf (so the default logprobs are over them). (): every token.
    allowed_token_ids: tuple[int, ...] = ()
    # -- version 9
    # SGLang's routed experts ("R3"): the MoE layers' chosen expert ids of every position the model
    # ran from routed_experts_start_len on (the prompt's, cached ones included, and each fed output
    # token's), returned with the request's last output. Needs worker.enable_return_routed_experts.
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0  # the first position returned, in [0, prompt tokens]
    # -- version 10
    # SGLang's token_ids_logprob: the logprobs of these ids (at most MAX_TOKEN_IDS_LOGPROB, unique) at
    # every position whose logprob comes back: each generated token's, and the prompt's from
    # prompt_logprobs_from on. Same distribution as the sampled token's logprob.
    token_ids_logprob: tuple[int, ...] = ()
    # SGLang's stop_regex: the output finishes (type stop, matched: the pattern) when one of these
    # Python regular expressions matches the output text (re.search), as a stop string does.
    stop_regex: tuple[str, ...] = ()
    # The prompt's token ids come back with the request's first output (vLLM's return_token_ids).
    return_prompt_token_ids: bool = False
    # Alternatives per scored prompt position; -1: top_logprobs (vLLM's prompt_logprobs asks for its
    # own count, so a request wanting only the prompt's does not pay for every sampled token's).
    prompt_top_logprobs: int = -1
    # -- version 11
    constraint: Constraint | None = None  # the output must match it (response_format, guided_*, json_schema, regex, ebnf)

    def prompt_alternatives(self) -> int:
        return self.top_logprobs if self.prompt_top_logprobs < 0 else self.prompt_top_logprobs

    def uses_penalty(self) -> bool:
        """Whether sampling counts the request's earlier tokens (the worker then keeps their history)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def reads_output(self) -> bool:
        """Whether the worker must know every output token fed before (penalties count them, a
        constraint's matcher consumed them), so a step after a prefix cache hit brings them."""
        return self.uses_penalty() or self.constraint is not None


class ToolCall(msgspec.Struct, frozen=True, array_like=True):
    """A function call an assistant message made (version 11), as OpenAI's messages carry it."""

    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str
    # -- version 11
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's
    tool_call_id: str | None = None  # a "tool" message: the call it answers
    name: str | None = None  # a "tool" message: the function's name


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One token with its logprob, and its text when asked (`SamplingParams.logprob_texts`)."""

    token_id: int
    logprob: float
    text: str | None = None
    # The token's bytes, only when they are not valid UTF-8 on their own (part of a character):
    # then `text` holds U+FFFD where the bytes are.
    raw: bytes | None = None


class FinishReason(msgspec.Struct, frozen=True, omit_defaults=True):
    """Why a request ended: `stop` (EOS, stop token or stop string), `length`, `abort` (asked for:
    a client, /abort_request, a pause) or `error` (the server failed it, e.g. its worker died: the
    gateway answers a 503, an SSE error event once streaming, never a finish_reason)."""

    type: str
    matched: int | str | None = None  # the stop token id or stop string, for `stop`
    length: int | None = None  # tokens generated, for `length`
    message: str | None = None  # for `abort` and `error`


class FinishRule(msgspec.Struct, frozen=True, array_like=True):
    """When a request ends by its tokens, resolved once by the tokenizer (`jaxstream.stopping` applies
    it): the scheduler and the detokenizer reach the same verdict on the same token. Version 6."""

    stop_token_ids: tuple[int, ...]  # the client's, plus EOS unless ignore_eos
    max_new_tokens: int  # the client's, capped by the context length (None asked: all the room left)
    min_new_tokens: int = 0  # no stop token ends it (or is sampled) before this many tokens


# ---------------------------------------------------------------------------------------------
# gateway -> tokenizer


class GenerateRequest(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """A client request, before tokenization. Exactly one of text, messages, input_ids is set."""

    rid: str
    gateway: str  # the gateway instance whose stream receives every reply
    sampling: SamplingParams
    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    input_ids: tuple[int, ...] | None = None
    add_special_tokens: bool = True  # for `text`; chat templates carry their own
    # -- version 3
    replica: int = 0  # the data-parallel replica the gateway chose: its scheduler gets the request
    # -- version 8
    # sampling.max_new_tokens as the client named it (max_completion_tokens, sampling_params.max_new_tokens,
    # ...): a refusal names the field the client sent
    max_tokens_name: str = "max_tokens"
    # -- version 10
    # vLLM's truncate_prompt_tokens: keep only the prompt's last k tokens (-1: as many as the context
    # holds); None: never truncate (a prompt too long is refused).
    truncate_prompt_tokens: int | None = None
    # For `messages` (vLLM's names): open an assistant turn after them, or continue the last
    # message (the assistant's, unfinished: no end-of-turn token after it). At most one of them.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    truncate_left: bool = True  # truncate_prompt_tokens keeps the prompt's end (vLLM's truncation_side "left"), else its start
    # -- version 11
    # For `messages`: OpenAI's `tools` (a JSON array of {"type": "function", "function": {...}}),
    # rendered by the chat template, or described in a system message when the template has no
    # place for them. None: no tools.
    tools: str | None = None


class TokenizeRequest(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """/tokenize: text, or chat messages rendered with the chat template, to ids. Answered with a
    TokenizeReply (or a RequestRejected) on the gateway's stream."""

    rid: str
    gateway: str
    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # for messages
    token_strs: bool = False  # also return each id's token string
    # -- version 10
    continue_final_message: bool = False  # for messages: leave the last one open (GenerateRequest's)
    # -- version 11
    tools: str | None = None  # for messages: GenerateRequest's


class DetokenizeRequest(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """/detokenize, and the text of a token-id prompt for `echo`."""

    rid: str
    gateway: str
    token_ids: tuple[int, ...]
    skip_special_tokens: bool = True


TokenizerInput = GenerateRequest | TokenizeRequest | DetokenizeRequest


# ---------------------------------------------------------------------------------------------
# -> scheduler


class TokenizedRequest(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """A request ready to schedule, with its finish rule resolved (`finish_rule()`)."""

    rid: str
    gateway: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    # -- up to version 5: the finish rule, flat (min_new_tokens in `sampling`); superseded by `finish`
    stop_token_ids: tuple[int, ...] = ()
    max_new_tokens: int = 0
    # -- version 6
    finish: FinishRule | None = None

    def finish_rule(self) -> FinishRule:
        if self.finish is not None:
            return self.finish
        return FinishRule(self.stop_token_ids, self.max_new_tokens, self.sampling.min_new_tokens)


class AbortRequests(msgspec.Struct, frozen=True, tag=True):
    """Client gone, or an admin abort. Idempotent; may arrive before the request itself."""

    rids: tuple[str, ...]
    message: str = "aborted"
    abort_all: bool = False  # every request the scheduler holds, whoever sent it (`rids` ignored)


class StopRequests(msgspec.Struct, frozen=True, tag=True):
    """The detokenizer matched a stop string: the scheduler ends these requests (no output needed)."""

    rids: tuple[str, ...]


class FlushCache(msgspec.Struct, frozen=True, tag=True):
    """/flush_cache: empty the prefix cache if no request runs or waits (never aborting one).
    Answered with a FlushCacheReply on the gateway's stream. Version 4."""

    rid: str  # of the exchange, for the gateway to route the reply
    gateway: str


class WriteStats(msgspec.Struct, frozen=True, tag=True):
    """Write your stats now, then answer (a ControlReply on the gateway's stream; version 12). Sent
    before /metrics, /stats and /v1/loads read the stats. What a client saw end before it asked is
    older than this message on the streams the scheduler reads in one read (its stop request on the
    scheduler stream, its step result on the results stream, which never holds more than the two
    steps in flight), so the stats written with the answer count it."""

    rid: str
    gateway: str


PAUSE_MODES = ("abort", "retract", "in_place")


class PauseGeneration(msgspec.Struct, frozen=True, tag=True):
    """/pause_generation on one replica (version 7): `abort` ends every request it holds (with its
    partial output), `retract` sends running requests back to waiting (their KV freed, recomputed
    on continue), `in_place` stops stepping (KV kept). Then no step runs until ContinueGeneration."""

    rid: str
    gateway: str
    mode: str = "abort"  # one of PAUSE_MODES


class ContinueGeneration(msgspec.Struct, frozen=True, tag=True):
    rid: str
    gateway: str


WEIGHT_PHASES = ("stage", "commit", "discard")
LOAD_FORMATS = ("auto", "safetensors", "gguf")  # SGLang's load_format names, of those a worker reads


class UpdateWeights(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """One phase of a weight update on one replica (version 7), relayed by the scheduler to its worker.

    `stage` loads new weights beside the live ones (from `path`, or the safetensors bytes in
    `blobs`, several stages adding up), checked, while the old weights keep serving; `commit`
    swaps them in once no step is in flight and no request runs (paused ones excepted), then sets
    `version` and flushes the prefix cache; `discard` drops what was staged. A commit with nothing
    staged changes the version only. Every replica stages before any commits: all or none swap."""

    rid: str
    gateway: str
    phase: str  # one of WEIGHT_PHASES
    path: str | None = None  # stage: a checkpoint (Hugging Face directory, GGUF file)
    load_format: str | None = None  # stage from path: None or one of LOAD_FORMATS
    blobs: tuple[str, ...] = ()  # stage: Redis keys of one safetensors buffer's parts, in order
    version: str | None = None  # commit: the new weight version (None: keep it)
    flush_cache: bool = True  # commit: empty the prefix cache (KV computed by the old weights)


MEMORY_TAGS = ("weights", "kv_cache")


class Memory(msgspec.Struct, frozen=True, tag=True):
    """/release_memory_occupation, /resume_memory_occupation on one replica (version 7): free or
    reallocate the worker's device buffers (same shapes and shardings; nothing recompiles). The
    weights come back from their last checkpoint; the KV cache empty."""

    rid: str
    gateway: str
    release: bool  # False: resume
    tags: tuple[str, ...] = MEMORY_TAGS


SchedulerInput = (TokenizedRequest | AbortRequests | StopRequests | FlushCache | PauseGeneration | ContinueGeneration
                  | UpdateWeights | Memory | WriteStats)


# ---------------------------------------------------------------------------------------------
# scheduler -> worker: one step for the whole batch
#
# Legend: T tokens in the step, R requests (rows) in the step, P pages per request row, A alternatives
# per token (top logprobs).


MAX_BANNED_TOKENS = 16  # the worker's sampler masks up to this many token ids per request
MAX_TOP_LOGPROBS = 20  # most alternatives per token (OpenAI's top_logprobs limit)
MAX_TOKEN_IDS_LOGPROB = 64  # most ids of a request's token_ids_logprob (the device gathers this many per row)


class StepSeq(msgspec.Struct, frozen=True, array_like=True):
    """One request's share of a step. Its tokens are `tokens[start : start + num_tokens]`."""

    rid: str
    start: int  # offset into Step.tokens
    num_tokens: int  # query length this step (prompt chunk, or 1 for decode)
    context_len: int  # tokens in the cache after this step, this step's included
    sample: bool  # False for a prompt chunk that is not the prompt's last
    # The request's sampling parameters, on its first seq since it took its slot (version 6; every
    # seq before): the worker keeps them by slot for its later seqs. None: the slot's, as kept.
    sampling: SamplingParams | None = None
    # Token ids this step must not sample: the request's stop tokens while it has fewer than
    # min_new_tokens tokens (vLLM's min_tokens). At most MAX_BANNED_TOKENS.
    banned: tuple[int, ...] = ()
    # -- version 2
    prompt_len: int = 0  # the request's prompt length: positions below it are prompt, the rest output
    # Score (return the logprobs of) the prompt tokens at positions q >= score_from that this step
    # covers: those of the window a step feeding [p0, context_len) can score (jaxstream.scoring:
    # q in [p0 + 1, context_len], q = 0 too when p0 == 0, with logprob NaN). -1: none. The scheduler
    # never asks for a position twice (a recompute after preemption skips those already scored).
    score_from: int = -1
    # The known token right after this step's tokens, when it is a prompt token (the next chunk's
    # first): this step's last logits score it. -1 otherwise.
    next_token: int = -1
    # -- version 4
    # [p0] int32: the request's tokens at positions [0, p0), which this step does not feed: set on
    # its first step since admission when the prefix cache gave it those positions and its sampling
    # reads earlier tokens (SamplingParams.reads_output: penalties, a constraint), for the worker's token
    # history and matcher. None otherwise.
    history: Array | None = None
    # -- version 5
    # The request's slot, in [0, scheduler max running requests): the worker keeps the token each
    # slot's last sampling row drew, on the device. -1: none (a sender before overlap).
    slot: int = -1
    # Overlap: the step was planned before the previous step's result arrived, and this seq's one
    # token (its value in Step.tokens is meaningless) is the one its slot sampled in the previous
    # step; the worker reads it there, on the device.
    follows: bool = False
    # -- version 13
    # Speculative decoding: the last `drafts` of its tokens are a draft (the scheduler's guess of
    # the tokens that follow its first), fed to be verified. The step samples at each of its last
    # drafts + 1 tokens, and its result brings the sampled tokens up to and including the first
    # that differs from the draft's token at the same position (all drafts + 1 when none does), as
    # consecutive rows of its rid. Never with `follows` or `banned`; its slot keeps nothing (the
    # request's next seq does not follow).
    drafts: int = 0


class Step(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    step_id: int
    seqs: tuple[StepSeq, ...]
    tokens: Array  # [T] int32
    positions: Array  # [T] int32
    page_table: Array  # [R, P] int32, row r = seqs[r]'s pages in order; -1 pads
    page_size: int = 0  # up to version 5; never read (the worker has its own, from the same config)


WorkerInput = Step | UpdateWeights | Memory


# ---------------------------------------------------------------------------------------------
# worker -> scheduler and detokenizer


class PromptScores(msgspec.Struct, frozen=True, array_like=True):
    """Logprobs of one request's prompt tokens scored in a step (StepSeq.score_from)."""

    rid: str
    first: int  # position of the first scored token; the rest follow contiguously
    token_ids: tuple[int, ...]  # the scored prompt tokens
    logprobs: tuple[float, ...]
    top_ids: Array | None = None  # [n, A] int32, best first; A >= the request's top_logprobs
    top_logprobs: Array | None = None  # [n, A] float32
    # -- version 10
    # [n, I] float32: each scored position's logprobs of the request's token_ids_logprob (I >= their count)
    ids_logprobs: Array | None = None
    ranks: Array | None = None  # [n] int32: each scored token's rank in its distribution (1: the most likely)


class RoutedExperts(msgspec.Struct, frozen=True, array_like=True):
    """The experts each MoE layer chose for one request's positions in a step (version 9): rows for
    positions first, first + 1, ... contiguous. A request's first step also brings the rows of the
    prompt positions the prefix cache gave it (kept per cache slot on the device). Dense layers' rows
    are 0, as SGLang's (its buffer is zeros and only MoE layers write theirs)."""

    rid: str
    first: int  # position of the first row
    ids: Array  # [n, L, k] int32: L every hidden layer, k experts per token, in the router's order (best first)


class StepResult(msgspec.Struct, frozen=True, tag=True):
    """One message per step: the sampled token of every seq with `sample=True`, in step order: one
    row each, or, for a seq with drafts (version 13), its verified tokens as consecutive rows of
    the same rid, in position order. Every per-row field has a row for each."""

    step_id: int
    rids: tuple[str, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # float32 log-probability of each sampled token
    step_ms: float = 0.0  # device time of the step
    # -- version 2
    # The most likely tokens of each sampled row, best first, when some row asked for
    # alternatives: [R, A] with R = len(rids) and A the step's largest top_logprobs (a row takes
    # its first top_logprobs). None when no row asked.
    top_ids: Array | None = None  # [R, A] int32
    top_logprobs: Array | None = None  # [R, A] float32
    scores: tuple[PromptScores, ...] = ()
    # -- version 5
    replica: int = 0  # the worker's replica: step ids count per replica
    # -- version 7
    weight_version: str = ""  # of the weights that computed the step
    # -- version 9
    # Routed experts of the seqs whose request asked (SamplingParams.return_routed_experts), from
    # their routed_experts_start_len on; () when none did.
    experts: tuple[RoutedExperts, ...] = ()
    # -- version 10
    # [R, I] float32: each sampled row's logprobs of its request's token_ids_logprob (the row's first
    # len of them; I the step's most); None when no row asked.
    ids_logprobs: Array | None = None


class ControlReply(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """A replica's answer to a control message (version 7): done, or why not."""

    rid: str
    ok: bool
    message: str = ""
    replica: int = 0
    weight_version: str = ""  # the replica's, after the message
    model_path: str = ""  # where its weights last came from (a checkpoint), after the message
    # pause: the requests it aborted, retracted or froze; commit: the requests that waited for it
    requests: int = 0


WorkerOutput = StepResult | ControlReply


# ---------------------------------------------------------------------------------------------
# scheduler -> detokenizer


class RequestStart(msgspec.Struct, frozen=True, array_like=True):
    rid: str
    gateway: str
    prompt_tokens: int
    stop: tuple[str, ...]
    # -- up to version 5: the finish rule, flat; superseded by `finish` (`finish_rule()`)
    stop_token_ids: tuple[int, ...] = ()
    max_new_tokens: int = 0
    min_new_tokens: int = 0
    skip_special_tokens: bool = True
    # -- version 2
    top_logprobs: int = 0  # alternatives to pass on per token
    logprob_texts: bool = False  # give each returned token its text
    no_stop_trim: bool = False  # a matched stop string stays in the text
    # -- version 3
    replica: int = 0  # the scheduler's replica: a stop string's finish goes back to it
    # -- version 5
    # The request's results are those of its replica's steps from this id on. With overlap a step
    # in flight may still sample for an ended request of the same rid (a client retrying it): the
    # detokenizer must not give that token to this one.
    first_step: int = 0
    # -- version 6
    finish: FinishRule | None = None
    # -- version 9
    # The first position of the routed experts the request asked for (its routed_experts_start_len);
    # -1: it asked for none. The detokenizer gathers them and sends them with the last output.
    routed_experts_from: int = -1
    # -- version 10
    token_ids_logprob: tuple[int, ...] = ()  # the ids whose logprobs come with every token (SamplingParams)
    stop_regex: tuple[str, ...] = ()  # patterns that finish the output, as `stop` (SamplingParams)
    prompt_ids: tuple[int, ...] = ()  # the prompt, when the request asked for its ids back
    prompt_top_logprobs: int = -1  # alternatives per scored prompt position (SamplingParams'); -1: top_logprobs

    def finish_rule(self) -> FinishRule:
        if self.finish is not None:
            return self.finish
        return FinishRule(self.stop_token_ids, self.max_new_tokens, self.min_new_tokens)


class RequestEnd(msgspec.Struct, frozen=True, array_like=True):
    """The scheduler ended a request for a reason the detokenizer cannot see (abort, error)."""

    rid: str
    gateway: str
    finish: FinishReason


class CacheHit(msgspec.Struct, frozen=True, array_like=True):
    """A request's first step took its first `cached_tokens` prompt tokens from the prefix cache."""

    rid: str
    cached_tokens: int


class RequestEvents(msgspec.Struct, frozen=True, tag=True):
    """Batched per scheduler iteration. Starts are sent before the request's first step, cache hits
    with it (before its first result)."""

    started: tuple[RequestStart, ...] = ()
    ended: tuple[RequestEnd, ...] = ()
    # -- version 4
    cache_hits: tuple[CacheHit, ...] = ()


DetokenizerInput = RequestEvents


# ---------------------------------------------------------------------------------------------
# -> gateway


class RequestOutput(msgspec.Struct, frozen=True, omit_defaults=True):
    """New output of one request since its previous RequestOutput."""

    rid: str
    text: str = ""  # new text, never a broken UTF-8 character, never part of a possible stop string
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    finish: FinishReason | None = None  # set exactly once, on the last output
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    # -- version 2
    token_texts: tuple[str, ...] = ()  # each of token_ids' own text, when the request asked for texts
    # With token_texts, when some token is only part of a UTF-8 character: each token's bytes (None
    # for one whose text is whole), as TokenLogprob.raw. () when every token's text is whole.
    token_raws: tuple[bytes | None, ...] = ()
    top_logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()  # per token of token_ids, best first
    # Prompt logprobs, all of them in the request's first output: positions prompt_logprobs_from on
    # (SamplingParams), each with its alternatives in prompt_top_logprobs when asked.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    prompt_top_logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()
    # -- version 4
    cached_tokens: int = 0  # prompt tokens read from the prefix cache (SGLang's cached_tokens)
    # -- version 7
    weight_version: str = ""  # of the weights that computed token_ids (one step's: one version)
    # -- version 9
    # On the last output of a request that asked (RequestStart.routed_experts_from): [n, L, k] int32,
    # the routed experts of positions [from, prompt + completion tokens - 1), or of as many of them
    # as ran before the request ended (an abort). The last sampled token never ran: no row.
    routed_experts: Array | None = None
    # -- version 10
    # Per token of token_ids, the logprobs of the request's token_ids_logprob, in its order.
    token_ids_logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()
    # With prompt_logprobs (first output): per prompt position, the same; and each prompt token's rank.
    prompt_token_ids_logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()
    prompt_ranks: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()  # the whole prompt, on the first output, when asked (return_prompt_token_ids)


class OutputBatch(msgspec.Struct, frozen=True, tag=True):
    """One message per step per gateway."""

    outputs: tuple[RequestOutput, ...]


class RequestRejected(msgspec.Struct, frozen=True, tag=True):
    """A request refused before it produced any token; reaches the client as an HTTP error."""

    rid: str
    status: int  # HTTP status, 400 for validation
    message: str
    param: str | None = None
    code: str | None = None


class TokenizeReply(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """The answer to a TokenizeRequest (token_ids) or a DetokenizeRequest (text)."""

    rid: str
    token_ids: tuple[int, ...] = ()
    text: str | None = None
    token_strs: tuple[str, ...] | None = None
    max_model_len: int = 0


class FlushCacheReply(msgspec.Struct, frozen=True, tag=True):
    """One replica's answer to a FlushCache: flushed, or why not (requests running or waiting)."""

    rid: str
    flushed: bool
    message: str = ""


GatewayInput = OutputBatch | RequestRejected | TokenizeReply | FlushCacheReply | ControlReply


def decoder(union: object) -> msgspec.msgpack.Decoder:
    """The one typed decoder of a stream's union."""
    return msgspec.msgpack.Decoder(union)


encode = msgspec.msgpack.Encoder().encode
