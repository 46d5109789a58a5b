"""SGLang's stop_regex through the whole fake stack: the output ends where a pattern first matches
the text (the match kept, nothing after it sent), finish type stop with the pattern as matched,
and the scheduler stops computing it (the autouse idle check). The fake worker continues a prompt
whose last token is t with t+1, t+2, ..."""

import json
import re

import httpx
import pytest

pytestmark = [pytest.mark.pipeline, pytest.mark.usefixtures("idle_after_each_test")]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def stack(fake_stack):
    return fake_stack


def continuation(tok, last: int, n: int) -> str:
    return tok.tokenizer.decode([(last + i) % tok.vocab_size for i in range(1, n + 1)], skip_special_tokens=True,
                                clean_up_tokenization_spaces=False)


def pattern_inside(full: str, piece: str) -> tuple[str, str]:
    """A pattern whose first match in `full` is `piece` (an alternative that never matches keeps it a
    regular expression), and the output that ends with that match."""
    assert piece and piece in full
    return rf"(?:\d{{99}}|{re.escape(piece)})", full[: full.index(piece) + len(piece)]


def test_generate_stop_regex_streamed(stack, tokenizer_info):
    full = continuation(tokenizer_info, 6000, 12)
    pattern, expected = pattern_inside(full, continuation(tokenizer_info, 6005, 1).strip())
    body = {"input_ids": [4000, 5000, 6000], "stream": True,
            "sampling_params": {"max_new_tokens": 500, "ignore_eos": True, "stop_regex": [pattern]}}
    with httpx.stream("POST", stack + "/generate", json=body, timeout=30) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    payloads = [json.loads(e) for e in events[:-1]]
    assert all(later["text"].startswith(earlier["text"]) for earlier, later in zip(payloads, payloads[1:]))
    assert payloads[-1]["text"] == expected
    assert payloads[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}


def test_completions_stop_regex(client, tokenizer_info):
    full = continuation(tokenizer_info, 700, 12)
    pattern, expected = pattern_inside(full, continuation(tokenizer_info, 704, 2).strip())
    r = client.completions.create(model=MODEL, prompt=[500, 600, 700], max_tokens=500,
                                  extra_body={"stop_regex": pattern, "ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].matched_stop == pattern
    assert r.choices[0].text == expected


@pytest.mark.parametrize("path,body,param", [
    ("/generate", {"text": "hi", "sampling_params": {"stop_regex": ["ok", "(unclosed"]}}, "sampling_params.stop_regex"),
    ("/v1/completions", {"prompt": "hi", "stop_regex": "a{2,1}"}, "stop_regex"),
    ("/v1/completions", {"prompt": "hi", "stop_regex": ["x"] * 17}, "stop_regex"),
])
def test_bad_stop_regex_is_a_400_naming_it(stack, path, body, param):
    r = httpx.post(stack + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
