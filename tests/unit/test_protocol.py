"""Every message round-trips through msgpack; messages recorded at the current protocol version
still decode as they were; nothing is pickled.

The recording (protocol_v<PROTOCOL_VERSION>.msgpack beside this file) is MESSAGES encoded when the
version was set, and together they set every field of every Struct of the contract. A change that
breaks them (a field retyped, reordered, removed, or added without a default) fails here. Any
change to the contract bumps PROTOCOL_VERSION: then record the new version's messages, from the
repository root:

    PYTHONPATH=. python tests/unit/test_protocol.py

which writes protocol_v<PROTOCOL_VERSION>.msgpack. The older recordings stay and must still decode,
unless the change meant to break them (then delete them in the same change, saying why).
"""

import re
from pathlib import Path

import msgspec
import numpy as np
import pytest

from jaxstream import protocol
from jaxstream.arrays import from_wire, to_wire
from jaxstream.protocol import (
    AbortRequests, CacheHit, ChatMessage, Constraint, ControlReply, DetokenizeRequest, FinishReason, FinishRule,
    FlushCache, FlushCacheReply, GenerateRequest, OutputBatch, PromptScores, RequestEnd, RequestEvents, RequestOutput,
    RequestRejected, RequestStart, RoutedExperts, SamplingParams, Step, StepResult, StepSeq, StopRequests,
    TokenizedRequest, TokenizeReply, TokenizeRequest, TokenLogprob, ToolCall,
)

HERE = Path(__file__).resolve().parent


def ints(*shape: int) -> protocol.Array:
    return to_wire(np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape))


def floats(*shape: int) -> protocol.Array:
    return to_wire(-np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape))


SAMPLING = SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=5, seed=3, stop=("x",), stop_token_ids=(9,))
EVERY_SAMPLING = SamplingParams(  # every field set
    max_new_tokens=None, temperature=0.5, top_p=0.9, top_k=5, min_p=0.05, seed=3, stop=("x",), stop_token_ids=(9,),
    ignore_eos=True, min_new_tokens=2, skip_special_tokens=False, presence_penalty=0.5, frequency_penalty=0.25,
    repetition_penalty=1.2, logit_bias=((3, -100.0),), top_logprobs=5, prompt_logprobs_from=0, raw_logprobs=True,
    logprob_texts=True, no_stop_trim=True, processed_logprobs=True, allowed_token_ids=(3, 4, 9), return_routed_experts=True,
    routed_experts_start_len=1, token_ids_logprob=(4, 5), stop_regex=("a+b",), return_prompt_token_ids=True,
    prompt_top_logprobs=2, constraint=Constraint("regex", "[ab]+"), channels=True, lora="math",
)
CALL = ChatMessage("assistant", "", tool_calls=(ToolCall("call_1", "f", '{"a": 1}'),), tool_call_id="call_0", name="f",
                   reasoning="thought")
TOOLS = '[{"type": "function", "function": {"name": "f"}}]'
TEMPLATE_KWARGS = '{"enable_thinking": false}'
STEP = Step(
    step_id=4,
    seqs=(StepSeq("r1", 0, 3, 3, True, SAMPLING), StepSeq("r2", 3, 1, 10, True, SamplingParams())),
    tokens=to_wire(np.array([1, 2, 3, 4], dtype=np.int32)),
    positions=to_wire(np.array([0, 1, 2, 9], dtype=np.int32)),
    page_table=to_wire(np.array([[0, -1], [1, 2]], dtype=np.int32)),
)
LOGPROBS = (TokenLogprob(5, -0.5, "a"), TokenLogprob(6, -1.0, "\ufffd", b"\xe4"))
MODEL_FACTS = protocol.ModelFacts(moe_layers=2, enable_return_routed_experts=True, num_hidden_layers=3,
                                  num_experts_per_tok=2, architectures="Qwen3MoeForCausalLM", model_type="qwen3_moe")
TOKENIZER_FACTS = protocol.TokenizerFacts(max_model_len=8192, vocab_size=49152, eos_token_ids=(2,), bos_token_id=1,
                                          has_chat_template=True)
BUCKETS = (0, 1, 1, 2)

MESSAGES = {  # union -> examples of every member; in all, every field of every Struct set
    protocol.TokenizerInput: [
        GenerateRequest("r", "g", SAMPLING, text="hi"),
        GenerateRequest("r", "g", SamplingParams(max_new_tokens=None), messages=(ChatMessage("user", "hi"),)),
        GenerateRequest("r", "g", SamplingParams(), input_ids=(1, 2), replica=1),
        GenerateRequest("r", "g", EVERY_SAMPLING, text="hi", messages=(CALL,), input_ids=(1, 2), add_special_tokens=False,
                        replica=1, max_tokens_name="sampling_params.max_new_tokens", truncate_prompt_tokens=-1,
                        add_generation_prompt=False, continue_final_message=True, truncate_left=False, tools=TOOLS,
                        chat_template_kwargs=TEMPLATE_KWARGS, forced_call="f"),
        TokenizeRequest("t", "g", text="hi", messages=(CALL,), add_special_tokens=False, add_generation_prompt=False,
                        token_strs=True, continue_final_message=True, tools=TOOLS, chat_template_kwargs=TEMPLATE_KWARGS),
        DetokenizeRequest("d", "g", (1, 2), skip_special_tokens=False),
    ],
    protocol.SchedulerInput: [
        TokenizedRequest("r", "g", (1, 2, 3), SAMPLING, FinishRule((2, 9), 7, 1)),
        AbortRequests(("a", "b"), "client disconnected"),
        AbortRequests((), "admin", abort_all=True),
        StopRequests(("a",)),
        FlushCache("f", "g"),
        protocol.WriteStats("w", "g"),
        protocol.PauseGeneration("p", "g", "retract"),
        protocol.ContinueGeneration("c", "g"),
        protocol.UpdateWeights("u", "g", "stage", path="/ckpt", load_format="gguf"),
        protocol.UpdateWeights("u", "g", "stage", blobs=("k:0", "k:1")),
        protocol.UpdateWeights("u", "g", "commit", version="v2", flush_cache=False),
        protocol.Memory("m", "g", True, ("kv_cache",)),
        protocol.WeightGroup("j", "g", "weight_update_group", True, "10.0.0.1", 29500, 3, 5, "gloo"),
        protocol.LoadAdapter("l", "g", "math", "/adapters/math"),
        protocol.UnloadAdapter("l", "g", "math"),
    ],
    protocol.WorkerInput: [
        STEP,
        Step(5, (StepSeq("r1", 0, 1, 9, True, EVERY_SAMPLING, banned=(2,), prompt_len=4, slot=1, follows=True, adapter=0),
                 StepSeq("r2", 1, 3, 10, True, prompt_len=10, score_from=8, next_token=7, history=ints(7), slot=2, drafts=2,
                          state_from=1, state_to=0)),
             tokens=ints(4), positions=ints(4), page_table=ints(2, 3)),
        protocol.UpdateWeights("u", "g", "discard"),
        protocol.Memory("m", "g", False),
        protocol.UpdateWeights("u", "g", "stage", broadcast=protocol.Broadcast("weight_update_group", ("a", "b"), ("bfloat16", "float32"),
                                                                                ((2, 3), ()), packing=1 << 20)),
        protocol.WeightGroup("j", "g", "weight_update_group", False),
        protocol.LoadAdapter("l", "g", "math", "", (("k:0", "k:1"), ("k2:0",)), 8, 16.0, ("q_proj", "v_proj"), True, "v4", 1),
    ],
    protocol.WorkerOutput: [
        StepResult(4, ("r1", "r2"), (5, 6), (-0.5, -1.25), step_ms=1.5),
        StepResult(6, ("r1",), (5,), (-0.5,), step_ms=2.5, top_ids=ints(1, 2), top_logprobs=floats(1, 2),
                   scores=(PromptScores("r1", 1, (2, 3), (-1.0, -2.0), ints(2, 2), floats(2, 2), floats(2, 2), ints(2)),),
                   replica=1, weight_version="v3", experts=(RoutedExperts("r1", 3, ints(3, 2, 2)),), ids_logprobs=floats(1, 2)),
        ControlReply("u", True, "swapped", 1, "v3", "/ckpt"),
        ControlReply("p", False, "paused", requests=3),
    ],
    protocol.DetokenizerInput: [
        RequestEvents(started=(RequestStart("r", "g", 3, ("x",), FinishRule((2,), 7)),
                               RequestStart("r2", "g", 3, (), FinishRule((2,), 7, 3), skip_special_tokens=False, top_logprobs=2,
                                            logprob_texts=True, no_stop_trim=True, replica=1, first_step=4,
                                            routed_experts_from=2, token_ids_logprob=(4, 5), stop_regex=("a+b",),
                                            prompt_ids=(1, 2, 3), prompt_top_logprobs=1, channels=True)),
                      ended=(RequestEnd("q", "g", FinishReason("abort", message="bye")),)),
        RequestEvents(),
        RequestEvents(cache_hits=(CacheHit("r", 32),)),
    ],
    protocol.GatewayInput: [
        OutputBatch((RequestOutput("r", "hé", (5,), (-0.5,), FinishReason("stop", matched=2), 3, 1),
                     RequestOutput("q", finish=FinishReason("length", length=4)))),
        OutputBatch((RequestOutput("r", "a\ufffd", (5, 6), (-0.5, -1.0), FinishReason("stop", matched="\n"), 3, 2,
                                   token_texts=("a", "\ufffd"), token_raws=(None, b"\xe4"), top_logprobs=(LOGPROBS, LOGPROBS),
                                   prompt_logprobs=LOGPROBS, prompt_top_logprobs=(LOGPROBS, LOGPROBS), cached_tokens=2,
                                   weight_version="v3", routed_experts=ints(4, 3, 2), token_ids_logprobs=(LOGPROBS, LOGPROBS),
                                   prompt_token_ids_logprobs=(LOGPROBS, LOGPROBS), prompt_ranks=(1, 3),
                                   prompt_token_ids=(1, 2, 3), seq=4,
                                   channels=(protocol.ChannelText(0, "analysis", "", "a"),
                                             protocol.ChannelText(1, "commentary", "functions.f", "\ufffd"))),)),
        RequestRejected("r", 400, "prompt must not be empty", "prompt", "invalid_prompt"),
        TokenizeReply("t", token_ids=(1, 2), token_strs=("a", "b"), max_model_len=8192),
        TokenizeReply("d", text="hi"),
        FlushCacheReply("f", True, "replica 0: 12 pages freed"),
        FlushCacheReply("f", False, "replica 1: 1 request running and 0 waiting"),
        ControlReply("p", True, "paused", requests=3),
    ],
    protocol.Stats: [
        protocol.WorkerStats(facts=protocol.ModelFacts(moe_layers=0, enable_return_routed_experts=False), steps=3,
                             weight_version="default", model_path="dummy", released="", rss_bytes=1 << 20),
        protocol.WorkerStats(facts=MODEL_FACTS, steps=9, weight_version="v3", model_path="/ckpt", released="kv_cache,weights",
                             rss_bytes=1 << 30, step_ms=12.5, compiled_shapes=54, compiles_after_ready=0,
                             device_bytes_in_use=1 << 29, constraint_mask_ms_p50=0.25, constraint_mask_ms_p99=1.5,
                             idle_gaps=7, idle_gap_ms_p50=0.1, idle_gap_ms_p90=0.2, idle_gap_ms_p99=0.4,
                             kv_bytes_per_token=46080),
        protocol.SchedulerStats(
            running=1, waiting=2, waiting_deferred=1, pages_used=5, pages_free=3, pages_total=8, pages_cached=2,
            pages_evictable=1, page_size=16, prefix_cache=1, max_running_requests=4, max_total_tokens=128, requests_total=9,
            prompt_tokens_total=90, generation_tokens_total=40, aborted_total=1, preempted_total=2,
            prefix_cache_queries_total=90, prefix_cache_hits_total=32, spec_decode_num_drafts_total=4,
            spec_decode_num_draft_tokens_total=12, spec_decode_num_accepted_tokens_total=6, spec_decode_acceptance_rate=0.5,
            request_queue_time_seconds_buckets=BUCKETS, request_queue_time_seconds_sum=0.5,
            request_prefill_time_seconds_buckets=BUCKETS, request_prefill_time_seconds_sum=0.25,
            request_decode_time_seconds_buckets=BUCKETS, request_decode_time_seconds_sum=1.5,
            request_inference_time_seconds_buckets=BUCKETS, request_inference_time_seconds_sum=1.75,
            iteration_tokens_total_buckets=BUCKETS, iteration_tokens_total_sum=130.0, max_queued_requests=16,
            awaiting_results_since=1.7e9, state_slots_total=4, state_slots_used=1, state_slots_free=3,
            state_snapshots_total=8, state_snapshots_used=3),
        protocol.TokenizerStats(facts=TOKENIZER_FACTS, processed=5, reclaimed=1),
        protocol.DetokenizerStats(requests=2, started=7),
    ],
}
UNIONS = {"TokenizerInput": protocol.TokenizerInput, "SchedulerInput": protocol.SchedulerInput,
          "WorkerInput": protocol.WorkerInput, "WorkerOutput": protocol.WorkerOutput,
          "DetokenizerInput": protocol.DetokenizerInput, "GatewayInput": protocol.GatewayInput, "Stats": protocol.Stats}


def recording(version: int) -> Path:
    return HERE / f"protocol_v{version}.msgpack"


def record() -> Path:
    """MESSAGES encoded now, by union name, as the current version's recording."""
    path = recording(protocol.PROTOCOL_VERSION)
    path.write_bytes(msgspec.msgpack.encode({name: [protocol.encode(m) for m in MESSAGES[union]]
                                             for name, union in UNIONS.items()}))
    return path


@pytest.mark.parametrize("union,message", [(u, m) for u, ms in MESSAGES.items() for m in ms])
def test_round_trip(union, message):
    decoded = protocol.decoder(union).decode(protocol.encode(message))
    assert decoded == message and type(decoded) is type(message)


def test_every_message_type_is_covered():
    covered = {type(m) for ms in MESSAGES.values() for m in ms}
    tagged = {cls for cls in vars(protocol).values()
              if isinstance(cls, type) and issubclass(cls, msgspec.Struct) and cls.__struct_config__.tag}
    assert tagged <= covered and set(MESSAGES) == set(UNIONS.values())


def set_fields(value, found: set[tuple[type, str]]) -> set[tuple[type, str]]:
    """(Struct, field) of every field `value` sets anywhere within it: a required one, or one not
    at its default."""
    if isinstance(value, msgspec.Struct):
        for field in msgspec.structs.fields(value):
            got = getattr(value, field.name)
            default = field.default_factory() if field.default_factory is not msgspec.NODEFAULT else field.default
            if field.required or got != default:
                found.add((type(value), field.name))
            set_fields(got, found)
    elif isinstance(value, tuple):
        for item in value:
            set_fields(item, found)
    return found


def test_the_examples_set_every_field_of_every_struct():
    # So that the recording pins each field's type: one left at its default would decode whatever it became.
    found: set[tuple[type, str]] = set()
    for ms in MESSAGES.values():
        for m in ms:
            set_fields(m, found)
    structs = {cls for cls in vars(protocol).values() if isinstance(cls, type) and issubclass(cls, msgspec.Struct)}
    unset = sorted(f"{cls.__name__}.{f.name}" for cls in structs for f in msgspec.structs.fields(cls) if (cls, f.name) not in found)
    assert not unset, f"no example sets {unset}"


def test_the_current_version_is_recorded_and_decodes_as_recorded():
    path = recording(protocol.PROTOCOL_VERSION)
    assert path.exists(), f"PROTOCOL_VERSION is {protocol.PROTOCOL_VERSION}: record it (this file's docstring)"
    recorded = msgspec.msgpack.decode(path.read_bytes())
    assert set(recorded) == set(UNIONS)
    for name, union in UNIONS.items():
        decoded = [protocol.decoder(union).decode(b) for b in recorded[name]]
        assert decoded == MESSAGES[union], f"{name}: a change to the contract needs a new PROTOCOL_VERSION (this file's docstring)"


def test_every_older_recording_still_decodes():
    versions = sorted(int(re.fullmatch(r"protocol_v(\d+)\.msgpack", p.name)[1]) for p in HERE.glob("protocol_v*.msgpack"))
    assert versions and versions[-1] == protocol.PROTOCOL_VERSION
    for version in versions[:-1]:
        recorded = msgspec.msgpack.decode(recording(version).read_bytes())
        for name, messages in recorded.items():
            for b in messages:
                protocol.decoder(UNIONS[name]).decode(b)  # raises for a message the change broke


def test_arrays_travel_as_raw_little_endian_bytes():
    for dtype in (np.int32, np.float32, np.dtype(">i4"), np.int64, np.bool_):
        array = np.arange(12).reshape(3, 4).astype(dtype)
        wire = to_wire(array)
        assert wire.dtype[0] in "<|" and wire.data == array.astype(array.dtype.newbyteorder("<")).tobytes()
        back = from_wire(protocol.decoder(protocol.Array).decode(protocol.encode(wire)))
        np.testing.assert_array_equal(back, array)
    assert from_wire(STEP.page_table).shape == (2, 2)


def test_a_step_sends_sampling_only_with_a_slots_first_seq():
    seqs = (StepSeq("a", 0, 1, 5, True, slot=0), StepSeq("b", 1, 1, 9, True, SamplingParams(temperature=0.0), slot=1))
    step = Step(2, seqs, to_wire(np.zeros(2, np.int32)), to_wire(np.zeros(2, np.int32)), to_wire(np.zeros((2, 3), np.int32)))
    wire = msgspec.msgpack.decode(protocol.encode(step))
    assert set(wire) == {"type", "step_id", "seqs", "tokens", "positions", "page_table"} and wire["seqs"][0][5] is None
    assert protocol.decoder(protocol.WorkerInput).decode(protocol.encode(step)) == step


def test_a_request_comes_with_its_finish_rule():
    no_rule = {"type": "TokenizedRequest", "rid": "r", "gateway": "g", "input_ids": [1, 2], "sampling": {}}
    with pytest.raises(msgspec.ValidationError, match="missing required field `finish`"):
        protocol.decoder(protocol.SchedulerInput).decode(msgspec.msgpack.encode(no_rule))


def test_unknown_fields_are_ignored():
    newer = {"type": "StopRequests", "rids": ["a"], "added_later": 5}
    assert protocol.decoder(protocol.SchedulerInput).decode(msgspec.msgpack.encode(newer)) == StopRequests(("a",))


def test_a_message_on_the_wrong_stream_fails_to_decode():
    with pytest.raises(msgspec.ValidationError):
        protocol.decoder(protocol.WorkerInput).decode(protocol.encode(StopRequests(("a",))))


def test_nothing_is_pickled():
    for ms in MESSAGES.values():
        for m in ms:
            assert msgspec.msgpack.decode(protocol.encode(m))  # plain msgpack, readable by any client
            assert not protocol.encode(m).startswith(b"\x80")  # pickle's protocol-2+ opcode


if __name__ == "__main__":
    print(f"wrote {record()}")
