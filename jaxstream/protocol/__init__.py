"""The wire contract: every message that crosses a Redis stream, the stats each service publishes
beside its heartbeat, and nothing else. `from jaxstream.protocol import X` names any of them.

Rules (see docs/style.md 1-2):
- Every file of this package imports only msgspec, the standard library and its siblings.
- Every message is a frozen, tagged Struct; each stream carries exactly one union, decoded by one
  typed decoder (`decoder(UNION)`) and dispatched with `match`.
- One version: every service ships together and speaks PROTOCOL_VERSION, which its heartbeat
  carries; the gateway's /health names an instance that speaks another (503), never tolerates it.
- A change to any Struct here bumps PROTOCOL_VERSION. New fields go last and have defaults; a field
  is never retyped, nor its place reused. A field no sender sets any more is removed, not kept for
  a sender that no longer exists. tests/unit/test_protocol.py keeps messages encoded at the current
  version (bytes checked in) and decodes them: what a change breaks fails there, and the bump
  records the new version's bytes.
- Arrays travel as `Array`: raw little-endian bytes with dtype and shape. Nothing is pickled.

Streams and their unions, one module each (names built in `jaxstream.names.Keys`); a stream
marked (r) exists once per data-parallel replica r, a scheduler+worker pair:

    tokenizer     gateway -> tokenizer_svc                   TokenizerInput  = GenerateRequest | TokenizeRequest | DetokenizeRequest
    scheduler(r)  tokenizer/gateway/detok -> scheduler r     SchedulerInput  = TokenizedRequest | AbortRequests | StopRequests | FlushCache
                                                                               | PauseGeneration | ContinueGeneration | UpdateWeights | Memory
                                                                               | WriteStats | WeightGroup | LoadAdapter | UnloadAdapter
    worker(r)     scheduler r -> worker r                    WorkerInput     = Step | UpdateWeights | Memory | WeightGroup | LoadAdapter
    results(r)    worker r -> scheduler r AND detokenizers   WorkerOutput    = StepResult | ControlReply   (a group each)
    detok.D       schedulers -> detokenizer D                DetokenizerInput = RequestEvents
    gateway.G     tokenizer/scheduler/detok -> gateway G     GatewayInput  = OutputBatch | RequestRejected | TokenizeReply | FlushCacheReply
                                                                             | ControlReply

    request.py    the request's description, shared by several of them (SamplingParams, FinishRule, ...)
    control.py    the control messages and their answers (flush, stats, pause, weights, collective groups, memory, LoRA adapters)
    stats.py      each service's heartbeat stats: Stats = WorkerStats | SchedulerStats | TokenizerStats | DetokenizerStats
"""

from __future__ import annotations

from jaxstream.protocol.control import (
    GROUP_BACKENDS, LOAD_FORMATS, MEMORY_TAGS, PACKED_WHOLE, PAUSE_MODES, WEIGHT_PHASES, WIRE_DTYPES, Broadcast, ContinueGeneration,
    ControlReply, FlushCache, FlushCacheReply, LoadAdapter, Memory, PauseGeneration, UnloadAdapter, UpdateWeights, WeightGroup,
    WriteStats,
)
from jaxstream.protocol.events import CacheHit, DetokenizerInput, RequestEnd, RequestEvents, RequestStart
from jaxstream.protocol.output import ChannelText, GatewayInput, OutputBatch, RequestOutput, RequestRejected, TokenizeReply
from jaxstream.protocol.request import (
    CHAT_MAX_NEW_TOKENS, GENERATE_MAX_NEW_TOKENS, ChatMessage, Constraint, FinishReason, FinishRule, SamplingParams,
    TokenLogprob, ToolCall,
)
from jaxstream.protocol.scheduler import AbortRequests, SchedulerInput, StopRequests, TokenizedRequest
from jaxstream.protocol.stats import (
    DetokenizerStats, ModelFacts, SchedulerStats, Stats, TokenizerFacts, TokenizerStats, WorkerStats,
)
from jaxstream.protocol.step import (
    MAX_BANNED_TOKENS, MAX_TOKEN_IDS_LOGPROB, MAX_TOP_LOGPROBS, PromptScores, RoutedExperts, Step, StepResult, StepSeq,
    WorkerInput, WorkerOutput,
)
from jaxstream.protocol.tokenizer import DetokenizeRequest, GenerateRequest, TokenizeRequest, TokenizerInput
from jaxstream.protocol.wire import Array, decoder, encode

PROTOCOL_VERSION = 7
