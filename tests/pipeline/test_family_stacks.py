"""Each served model family through the whole stack with the official client
(tests/pipeline/family_stacks.py, run in the background: tests/background.py): a greedy chat answer,
the same answer streamed, a call in the family's own syntax read into tool_calls by its tool parser,
for a reasoning family its thinking read into reasoning_content apart from content, and for an MoE
served with the routed-experts export (`routed`) one /generate's experts per row and layer. Read after
every other test (tests/conftest.py), by when the script is done or nearly so. A failure shows the
family's stack log's end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.pipeline.family_stacks import (ANSWER, CITY, FAMILIES, NUMBERS, ROUTED_NEW_TOKENS, ROUTED_PROMPT, THOUGHT,
                                          WEATHER)

WAIT_S = 1200  # every family's stack one after another, at the lowest priority, compiling included
pytestmark = [pytest.mark.pipeline, pytest.mark.timeout(WAIT_S)]


@pytest.fixture(scope="module")
def seen(family_stack_runs) -> dict[str, dict]:
    """family -> what its stack gave (family_stacks.py's JSON line)."""
    lines = [json.loads(line) for line in family_stack_runs.stdout("family_stacks", timeout=WAIT_S).splitlines()
             if line.startswith("{")]
    return {line["family"]: line for line in lines}


def line_of(seen: dict[str, dict], name: str) -> tuple[dict, str]:
    """What the family's stack gave, and the readable end of a failure: the error and the stack's log."""
    assert name in seen, f"family_stacks.py printed no line for {name}"
    line = seen[name]
    if "skipped" in line:
        pytest.skip(line["skipped"])
    return line, f"{name}: {line['error']}\n--- its stack's log, the end ---\n{line['log_tail']}"


@pytest.mark.parametrize("name", FAMILIES)
def test_the_stack_served_and_stopped_cleanly(seen, name):
    line, why = line_of(seen, name)
    assert line["error"] is None, why
    assert (line["exit_code"], line["traceback"]) == (0, False), why


@pytest.mark.parametrize("name", FAMILIES)
def test_a_chat_answer_and_the_same_answer_streamed(seen, name):
    line, why = line_of(seen, name)
    chat = line.get("chat") or {}
    assert chat.get("content") and chat["finish_reason"] in ("stop", "length"), why
    assert (line["streamed"], line["streamed_finish"]) == (chat["content"], [chat["finish_reason"]]), why


@pytest.mark.parametrize("name", FAMILIES)
def test_a_call_in_the_familys_syntax_is_read_into_tool_calls(seen, name):
    line, why = line_of(seen, name)
    call = line.get("call") or {}
    assert call.get("calls") == [[WEATHER["function"]["name"], {"city": CITY}]], why
    # finish_reason as vLLM's: "tool_calls" for an "auto" call, the engine's own for a named one (Harmony's)
    finish = "stop" if FAMILIES[name].call is None else "tool_calls"
    assert (call["content"], call["reasoning"], call["finish_reason"]) == (None, None, finish), why
    assert (json.loads(call["streamed_arguments"]), call["streamed_content"]) == ({"city": CITY}, ""), why


@pytest.mark.parametrize("name", [name for name, family in FAMILIES.items() if family.thinks])
def test_a_reasoning_familys_thinking_is_reasoning_content_apart_from_content(seen, name):
    line, why = line_of(seen, name)
    thinking = line.get("thinking") or {}
    assert (thinking.get("reasoning"), thinking.get("content")) == (THOUGHT, ANSWER), why
    assert (thinking["streamed_reasoning"], thinking["streamed_content"]) == (THOUGHT, ANSWER), why


@pytest.mark.parametrize("name", [name for name, family in FAMILIES.items() if family.routed])
def test_an_moe_families_routed_experts_come_back_for_every_row_and_layer(seen, name):
    line, why = line_of(seen, name)
    routed = line.get("routed") or {}
    assert (routed.get("dtype"), routed.get("start_len")) == ("int32", 0), why
    config = {**NUMBERS, **FAMILIES[name].config}
    dense, experts, top_k = config["first_k_dense_replace"], config["n_routed_experts"], config["num_experts_per_tok"]
    rows = np.array(routed["rows"])
    # A row per token that ran: the prompt's and every output's but the last (as tests/pipeline/test_r3_stack.py)
    assert rows.shape == (len(ROUTED_PROMPT) + ROUTED_NEW_TOKENS - 1, config["num_hidden_layers"], top_k), why
    assert not rows[:, :dense].any(), why  # the dense layers: 0s
    moe = rows[:, dense:]
    assert ((0 <= moe) & (moe < experts)).all(), why
    assert all(len(set(token)) == top_k for token in moe.reshape(-1, top_k).tolist()), why  # k distinct experts a token
