"""Every message round-trips through msgpack; older messages still decode; nothing is pickled."""

import msgspec
import numpy as np
import pytest

from jaxstream import protocol
from jaxstream.arrays import from_wire, to_wire
from jaxstream.protocol import (
    AbortRequests, CacheHit, ChatMessage, DetokenizeRequest, FinishReason, FinishRule, FlushCache, FlushCacheReply, GenerateRequest,
    OutputBatch, PromptScores, RequestEnd, RequestEvents, RequestOutput, RequestRejected, RequestStart, SamplingParams,
    Step, StepResult, StepSeq, StopRequests, TokenizedRequest, TokenizeReply, TokenizeRequest, TokenLogprob,
)

SAMPLING = SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=5, seed=3, stop=("x",), stop_token_ids=(9,))
STEP = Step(
    step_id=4,
    seqs=(StepSeq("r1", 0, 3, 3, True, SAMPLING), StepSeq("r2", 3, 1, 10, True, SamplingParams())),
    tokens=to_wire(np.array([1, 2, 3, 4], dtype=np.int32)),
    positions=to_wire(np.array([0, 1, 2, 9], dtype=np.int32)),
    page_table=to_wire(np.array([[0, -1], [1, 2]], dtype=np.int32)),
    page_size=8,
)

MESSAGES = {  # union -> examples of every member
    protocol.TokenizerInput: [
        GenerateRequest("r", "g", SAMPLING, text="hi"),
        GenerateRequest("r", "g", SamplingParams(max_new_tokens=None), messages=(ChatMessage("user", "hi"),)),
        GenerateRequest("r", "g", SamplingParams(), input_ids=(1, 2)),
        GenerateRequest("r", "g", SamplingParams(), input_ids=(1, 2), replica=1),
        GenerateRequest("r", "g", SamplingParams(max_new_tokens=9), text="hi", max_tokens_name="sampling_params.max_new_tokens"),
        GenerateRequest("r", "g", SamplingParams(presence_penalty=0.5, logit_bias=((3, -100.0),), top_logprobs=5,
                                                 prompt_logprobs_from=0, raw_logprobs=True, logprob_texts=True),
                        text="hi"),
        TokenizeRequest("t", "g", text="hi", add_special_tokens=False, token_strs=True),
        TokenizeRequest("t", "g", messages=(ChatMessage("user", "hi"),)),
        DetokenizeRequest("d", "g", (1, 2), skip_special_tokens=False),
    ],
    protocol.SchedulerInput: [
        TokenizedRequest("r", "g", (1, 2, 3), SAMPLING, finish=FinishRule((2, 9), 7, 1)),
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
    ],
    protocol.WorkerInput: [
        STEP,
        Step(5, (StepSeq("r1", 0, 2, 10, True, SamplingParams(repetition_penalty=1.2), prompt_len=10,
                         history=to_wire(np.arange(8, dtype=np.int32))),),
             tokens=to_wire(np.array([8, 9], dtype=np.int32)), positions=to_wire(np.array([8, 9], dtype=np.int32)),
             page_table=to_wire(np.array([[0, 1, 2]], dtype=np.int32)), page_size=4),
        protocol.UpdateWeights("u", "g", "discard"),
        protocol.Memory("m", "g", False),
    ],
    protocol.WorkerOutput: [
        StepResult(4, ("r1", "r2"), (5, 6), (-0.5, -1.25), step_ms=1.5),
        StepResult(4, ("r1",), (5,), (-0.5,), top_ids=to_wire(np.array([[5, 7]], np.int32)),
                   top_logprobs=to_wire(np.array([[-0.5, -1.5]], np.float32)),
                   scores=(PromptScores("r1", 1, (2, 3), (-1.0, -2.0)),)),
        StepResult(5, ("r1",), (5,), (-0.5,), replica=1, weight_version="v3"),
        StepResult(6, ("r1",), (5,), (-0.5,), experts=(protocol.RoutedExperts("r1", 3, to_wire(np.arange(12, dtype=np.int32).reshape(3, 2, 2))),)),
        protocol.ControlReply("u", True, "swapped", 1, "v3", "/ckpt"),
    ],
    protocol.DetokenizerInput: [
        RequestEvents(started=(RequestStart("r", "g", 3, ("x",), finish=FinishRule((2,), 7)),
                          RequestStart("r2", "g", 3, (), top_logprobs=2, logprob_texts=True, finish=FinishRule((2,), 7, 3)),
                          RequestStart("r3", "g", 3, (), skip_special_tokens=False, replica=1, finish=FinishRule((), 7)),
                          RequestStart("r4", "g", 3, (), finish=FinishRule((), 7), routed_experts_from=2)),
                      ended=(RequestEnd("q", "g", FinishReason("abort", message="bye")),)),
        RequestEvents(),
        RequestEvents(cache_hits=(CacheHit("r", 32),)),
    ],
    protocol.GatewayInput: [
        OutputBatch((RequestOutput("r", "hé", (5,), (-0.5,), FinishReason("stop", matched=2), 3, 1),
                     RequestOutput("q", finish=FinishReason("length", length=4)))),
        RequestRejected("r", 400, "prompt must not be empty", "prompt"),
        OutputBatch((RequestOutput("r", "a", (5,), (-0.5,), token_texts=("a",),
                                   top_logprobs=((TokenLogprob(5, -0.5, "a"), TokenLogprob(6, -1.0, "\ufffd", b"\xe4")),),
                                   prompt_logprobs=(TokenLogprob(2, -3.0, "b"),)),)),
        TokenizeReply("t", token_ids=(1, 2), token_strs=("a", "b"), max_model_len=8192),
        TokenizeReply("d", text="hi"),
        OutputBatch((RequestOutput("r", "a", (5,), (-0.5,), prompt_tokens=40, completion_tokens=1, cached_tokens=32),)),
        FlushCacheReply("f", True, "replica 0: 12 pages freed"),
        FlushCacheReply("f", False, "replica 1: 1 request running and 0 waiting"),
        OutputBatch((RequestOutput("r", "a", (5,), (-0.5,), weight_version="v3"),)),
        OutputBatch((RequestOutput("r", "a", (5,), (-0.5,), finish=FinishReason("length", length=1),
                                   routed_experts=to_wire(np.zeros((2, 3, 2), np.int32))),)),
        protocol.ControlReply("p", True, "paused", requests=3),
    ],
}


@pytest.mark.parametrize("union,message", [(u, m) for u, ms in MESSAGES.items() for m in ms])
def test_round_trip(union, message):
    decoded = protocol.decoder(union).decode(protocol.encode(message))
    assert decoded == message and type(decoded) is type(message)


def test_every_message_type_is_covered():
    covered = {type(m) for ms in MESSAGES.values() for m in ms}
    tagged = {cls for cls in vars(protocol).values()
              if isinstance(cls, type) and issubclass(cls, msgspec.Struct) and cls.__struct_config__.tag}
    assert tagged <= covered


def test_arrays_travel_as_raw_little_endian_bytes():
    for dtype in (np.int32, np.float32, np.dtype(">i4"), np.int64, np.bool_):
        array = np.arange(12).reshape(3, 4).astype(dtype)
        wire = to_wire(array)
        assert wire.dtype[0] in "<|" and wire.data == array.astype(array.dtype.newbyteorder("<")).tobytes()
        back = from_wire(protocol.decoder(protocol.Array).decode(protocol.encode(wire)))
        np.testing.assert_array_equal(back, array)
    assert from_wire(STEP.page_table).shape == (2, 2)


def test_messages_of_the_previous_version_decode():
    # A version-1 sender knew no field added later: such fields are omitted on the wire and take
    # their defaults. Simulate by dropping every field that has a default.
    old_result = {"type": "StepResult", "step_id": 1, "rids": ["a"], "token_ids": [3], "logprobs": [-0.1]}
    decoded = protocol.decoder(protocol.WorkerOutput).decode(msgspec.msgpack.encode(old_result))
    assert decoded == StepResult(1, ("a",), (3,), (-0.1,), step_ms=0.0)
    old_request = {"type": "GenerateRequest", "rid": "r", "gateway": "g", "sampling": {}, "text": "hi"}
    decoded = protocol.decoder(protocol.TokenizerInput).decode(msgspec.msgpack.encode(old_request))
    assert decoded.sampling == SamplingParams() and decoded.add_special_tokens is True
    assert decoded.replica == 0  # a version-2 gateway knew one replica
    assert decoded.max_tokens_name == "max_tokens"  # a version-7 gateway named no field
    assert protocol.PROTOCOL_VERSION == 13  # version 13 added StepSeq.drafts


def test_version_12_steps_decode_without_drafts():
    # Version 13 added speculative decoding: a version-12 scheduler's seqs carry no draft.
    v12_seq = ["r", 0, 1, 5, True, None, [], 4, -1, -1, None, 3, True]
    v12_step = {"type": "Step", "step_id": 7, "seqs": [v12_seq], "tokens": to_wire(np.zeros(1, np.int32)),
                "positions": to_wire(np.array([4], np.int32)), "page_table": to_wire(np.zeros((1, 1), np.int32))}
    step = protocol.decoder(protocol.WorkerInput).decode(msgspec.msgpack.encode(v12_step))
    assert step.seqs[0].drafts == 0 and step.seqs[0].follows and step.seqs[0].slot == 3


def test_version_10_messages_decode_with_no_constraint_and_no_tools():
    # Version 11 added constrained decoding and tools: a version-10 sender's messages ask for neither.
    v10_request = {"type": "GenerateRequest", "rid": "r", "gateway": "g", "sampling": {"stop_regex": ["x"]},
                   "messages": [{"role": "user", "content": "hi"}], "truncate_left": False}
    decoded = protocol.decoder(protocol.TokenizerInput).decode(msgspec.msgpack.encode(v10_request))
    assert decoded.sampling.constraint is None and decoded.tools is None and not decoded.sampling.reads_output()
    assert decoded.messages[0] == protocol.ChatMessage("user", "hi") and decoded.messages[0].tool_calls == ()
    constrained = SamplingParams(constraint=protocol.Constraint("regex", "[ab]+"))
    assert constrained.reads_output() and not constrained.uses_penalty()
    call = protocol.ChatMessage("assistant", "", tool_calls=(protocol.ToolCall("call_1", "f", '{"a": 1}'),))
    request = protocol.GenerateRequest("r", "g", constrained, messages=(call,), tools='[{"type": "function"}]')
    assert protocol.decoder(protocol.TokenizerInput).decode(protocol.encode(request)) == request


def test_version_9_messages_decode_asking_for_no_version_10_extension():
    # Version 10 added token_ids_logprob, stop_regex, prompt ids and ranks, truncation and chat
    # continuation: a version-9 sender's messages decode as asking for none of them.
    v9_request = {"type": "GenerateRequest", "rid": "r", "gateway": "g", "sampling": {"top_logprobs": 2},
                  "messages": [{"role": "user", "content": "hi"}], "max_tokens_name": "max_tokens"}
    decoded = protocol.decoder(protocol.TokenizerInput).decode(msgspec.msgpack.encode(v9_request))
    assert decoded.truncate_prompt_tokens is None and decoded.add_generation_prompt and not decoded.continue_final_message
    assert decoded.truncate_left
    assert decoded.sampling.token_ids_logprob == () and decoded.sampling.stop_regex == ()
    assert not decoded.sampling.return_prompt_token_ids
    v9_start = ["r", "g", 3, [], [], 0, 0, True, 0, False, False, 0, 4, [[2], 7, 0], -1]
    start = protocol.decoder(protocol.DetokenizerInput).decode(msgspec.msgpack.encode({"type": "RequestEvents", "started": [v9_start]}))
    assert start.started[0].token_ids_logprob == () and start.started[0].prompt_ids == () and start.started[0].stop_regex == ()
    assert start.started[0].prompt_top_logprobs == -1  # as many as top_logprobs, as before
    assert decoded.sampling.prompt_alternatives() == 2
    v9_scores = ["r", 1, [4], [-0.5], None, None]
    v9_result = {"type": "StepResult", "step_id": 3, "rids": ["r"], "token_ids": [5], "logprobs": [-1.0], "step_ms": 1.0,
                 "top_ids": None, "top_logprobs": None, "scores": [v9_scores], "replica": 0, "weight_version": "v", "experts": []}
    result = protocol.decoder(protocol.WorkerOutput).decode(msgspec.msgpack.encode(v9_result))
    assert result.ids_logprobs is None and result.scores[0].ids_logprobs is None and result.scores[0].ranks is None
    v9_output = {"type": "OutputBatch", "outputs": [{"rid": "r", "token_ids": [5], "routed_experts": None}]}
    out = protocol.decoder(protocol.GatewayInput).decode(msgspec.msgpack.encode(v9_output)).outputs[0]
    assert out.token_ids_logprobs == () and out.prompt_ranks == () and out.prompt_token_ids == ()


def test_version_8_messages_decode_without_routed_experts():
    # Version 9 added routed experts: a version-8 sender's messages decode as asking for none.
    v8_sampling = {"temperature": 0.5}
    v8_request = {"type": "TokenizedRequest", "rid": "r", "gateway": "g", "input_ids": [1, 2], "sampling": v8_sampling,
                  "finish": [[2], 7, 0]}
    decoded = protocol.decoder(protocol.SchedulerInput).decode(msgspec.msgpack.encode(v8_request))
    assert not decoded.sampling.return_routed_experts and decoded.sampling.routed_experts_start_len == 0
    v8_result = {"type": "StepResult", "step_id": 3, "rids": ["r"], "token_ids": [5], "logprobs": [-1.0], "step_ms": 1.0,
                 "top_ids": None, "top_logprobs": None, "scores": [], "replica": 0, "weight_version": "v"}
    assert protocol.decoder(protocol.WorkerOutput).decode(msgspec.msgpack.encode(v8_result)).experts == ()
    v8_start = ["r", "g", 3, [], [], 0, 0, True, 0, False, False, 0, 4, [[2], 7, 0]]
    start = protocol.decoder(protocol.DetokenizerInput).decode(msgspec.msgpack.encode({"type": "RequestEvents", "started": [v8_start]}))
    assert start.started[0].routed_experts_from == -1 and start.started[0].first_step == 4
    v8_output = {"type": "OutputBatch", "outputs": [{"rid": "r", "token_ids": [5], "weight_version": "v"}]}
    assert protocol.decoder(protocol.GatewayInput).decode(msgspec.msgpack.encode(v8_output)).outputs[0].routed_experts is None


def test_version_5_messages_decode_with_their_finish_rule_and_sampling():
    # Version 6 superseded the flat finish fields by FinishRule and sends sampling once per slot:
    # a version-5 sender's messages decode, and each accessor gives the rule they held.
    v5_request = {"type": "TokenizedRequest", "rid": "r", "gateway": "g", "input_ids": [1, 2],
                  "sampling": {"min_new_tokens": 2}, "stop_token_ids": [2, 9], "max_new_tokens": 7}
    decoded = protocol.decoder(protocol.SchedulerInput).decode(msgspec.msgpack.encode(v5_request))
    assert decoded.finish is None and decoded.finish_rule() == FinishRule((2, 9), 7, 2)
    v5_start = ["r", "g", 3, ["x"], [2], 7, 1, False, 0, False, False, 0, 4]
    v5_events = {"type": "RequestEvents", "started": [v5_start]}
    start = protocol.decoder(protocol.DetokenizerInput).decode(msgspec.msgpack.encode(v5_events)).started[0]
    assert start.finish_rule() == FinishRule((2,), 7, 1) and not start.skip_special_tokens and start.first_step == 4
    # A version-5 Step: every seq brought its sampling, and page_size was sent.
    v5_seq = ["a", 0, 1, 5, True, {"temperature": 0.5}, [], 5, -1, -1, None, 3, False]
    array = ["<i4", [1], b"\0" * 4]
    step = {"type": "Step", "step_id": 1, "seqs": [v5_seq], "tokens": array, "positions": array,
            "page_table": ["<i4", [1, 1], b"\0" * 4], "page_size": 16}
    seq = protocol.decoder(protocol.WorkerInput).decode(msgspec.msgpack.encode(step)).seqs[0]
    assert seq.sampling == SamplingParams(temperature=0.5) and seq.slot == 3


def test_a_version_6_step_sends_sampling_only_with_a_slots_first_seq():
    seqs = (StepSeq("a", 0, 1, 5, True, slot=0), StepSeq("b", 1, 1, 9, True, SamplingParams(temperature=0.0), slot=1))
    step = Step(2, seqs, to_wire(np.zeros(2, np.int32)), to_wire(np.zeros(2, np.int32)), to_wire(np.zeros((2, 3), np.int32)))
    wire = msgspec.msgpack.decode(protocol.encode(step))
    assert "page_size" not in wire and wire["seqs"][0][5] is None
    assert protocol.decoder(protocol.WorkerInput).decode(protocol.encode(step)) == step


def test_version_4_steps_decode_with_version_5_defaults():
    # StepSeq is array-like: a version-4 scheduler sent eleven elements, `slot` came twelfth.
    v4_seq = ["a", 0, 1, 5, True, {}, [], 5, -1, -1, None]
    array = ["<i4", [1], b"\0" * 4]
    step = {"type": "Step", "step_id": 1, "seqs": [v4_seq], "tokens": array, "positions": array,
            "page_table": ["<i4", [1, 1], b"\0" * 4], "page_size": 16}
    seq = protocol.decoder(protocol.WorkerInput).decode(msgspec.msgpack.encode(step)).seqs[0]
    assert seq.slot == -1 and not seq.follows and seq.history is None
    v4_events = {"type": "RequestEvents", "started": [["r", "g", 3, [], [2], 7, 0, True, 0, False, False, 1]]}
    assert protocol.decoder(protocol.DetokenizerInput).decode(msgspec.msgpack.encode(v4_events)).started[0].first_step == 0
    v4_result = {"type": "StepResult", "step_id": 3, "rids": ["r"], "token_ids": [5], "logprobs": [-1.0]}
    assert protocol.decoder(protocol.WorkerOutput).decode(msgspec.msgpack.encode(v4_result)).replica == 0


def test_version_3_messages_decode_with_version_4_defaults():
    # StepSeq is array-like: a version-3 scheduler sent ten elements, `history` came eleventh.
    v3_seq = ["a", 0, 1, 5, True, {"repetition_penalty": 1.5}, [], 5, -1, -1]
    array = ["<i4", [1], b"\0" * 4]
    step = {"type": "Step", "step_id": 1, "seqs": [v3_seq], "tokens": array, "positions": array,
            "page_table": ["<i4", [1, 1], b"\0" * 4], "page_size": 16}
    seq = protocol.decoder(protocol.WorkerInput).decode(msgspec.msgpack.encode(step)).seqs[0]
    assert seq.history is None and seq.sampling.uses_penalty()
    v3_events = {"type": "RequestEvents", "started": [["r", "g", 3, [], [2], 7, 0, True, 0, False, False, 1]], "ended": []}
    events = protocol.decoder(protocol.DetokenizerInput).decode(msgspec.msgpack.encode(v3_events))
    assert events.cache_hits == () and events.started[0].replica == 1
    v3_output = {"type": "OutputBatch", "outputs": [{"rid": "r", "text": "a", "token_ids": [5], "prompt_tokens": 3}]}
    out = protocol.decoder(protocol.GatewayInput).decode(msgspec.msgpack.encode(v3_output)).outputs[0]
    assert out.cached_tokens == 0 and out.prompt_tokens == 3


def test_version_2_messages_decode_with_version_3_defaults():
    # RequestStart is array-like: a version-2 scheduler sent eleven elements, `replica` came twelfth.
    v2_start = ["r", "g", 3, ["x"], [2], 7, 0, True, 2, True, False]
    events = {"type": "RequestEvents", "started": [v2_start]}
    start = protocol.decoder(protocol.DetokenizerInput).decode(msgspec.msgpack.encode(events)).started[0]
    assert (start.top_logprobs, start.logprob_texts, start.replica) == (2, True, 0)
    v2_request = {"type": "GenerateRequest", "rid": "r", "gateway": "g", "sampling": {}, "input_ids": [1]}
    assert protocol.decoder(protocol.TokenizerInput).decode(msgspec.msgpack.encode(v2_request)).replica == 0


def test_version_1_messages_decode_with_version_2_defaults():
    # Array-like structs gained trailing fields in version 2: a version-1 sender's shorter arrays decode.
    v1_seq = ["a", 0, 1, 5, True, {}, [2]]
    array = ["<i4", [1], b"\0" * 4]
    step = {"type": "Step", "step_id": 1, "seqs": [v1_seq], "tokens": array, "positions": array,
            "page_table": ["<i4", [1, 1], b"\0" * 4], "page_size": 16}
    seq = protocol.decoder(protocol.WorkerInput).decode(msgspec.msgpack.encode(step)).seqs[0]
    assert (seq.banned, seq.prompt_len, seq.score_from, seq.next_token) == ((2,), 0, -1, -1)
    v1_start = ["r", "g", 3, ["x"], [2], 7, 0, True]
    events = {"type": "RequestEvents", "started": [v1_start]}
    start = protocol.decoder(protocol.DetokenizerInput).decode(msgspec.msgpack.encode(events)).started[0]
    assert (start.top_logprobs, start.logprob_texts) == (0, False)
    v1_output = {"type": "OutputBatch", "outputs": [{"rid": "r", "text": "a", "token_ids": [5]}]}
    out = protocol.decoder(protocol.GatewayInput).decode(msgspec.msgpack.encode(v1_output)).outputs[0]
    assert out.top_logprobs == () and out.prompt_logprobs == ()


def test_a_step_seq_from_before_banned_decodes_with_none_banned():
    # StepSeq is array-like: the previous version sent six elements, `banned` came seventh.
    old_seq = ["a", 0, 1, 5, True, {}]
    array = ["<i4", [1], b"\0" * 4]
    step = {"type": "Step", "step_id": 1, "seqs": [old_seq], "tokens": array, "positions": array,
            "page_table": ["<i4", [1, 1], b"\0" * 4], "page_size": 16}
    decoded = protocol.decoder(protocol.WorkerInput).decode(msgspec.msgpack.encode(step))
    assert decoded.seqs[0].banned == () and decoded.seqs[0].context_len == 5


def test_unknown_fields_from_a_newer_sender_are_ignored():
    newer = {"type": "StopRequests", "rids": ["a"], "added_in_v2": 5}
    assert protocol.decoder(protocol.SchedulerInput).decode(msgspec.msgpack.encode(newer)) == StopRequests(("a",))


def test_a_message_on_the_wrong_stream_fails_to_decode():
    with pytest.raises(msgspec.ValidationError):
        protocol.decoder(protocol.WorkerInput).decode(protocol.encode(StopRequests(("a",))))


def test_nothing_is_pickled():
    for ms in MESSAGES.values():
        for m in ms:
            assert msgspec.msgpack.decode(protocol.encode(m))  # plain msgpack, readable by any client
            assert not protocol.encode(m).startswith(b"\x80")  # pickle's protocol-2+ opcode


def test_the_contract_imports_only_msgspec_and_the_standard_library():
    import ast
    import sys
    from pathlib import Path

    tree = ast.parse(Path(protocol.__file__).read_text())
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert roots - {"msgspec", "__future__"} <= set(sys.stdlib_module_names)
