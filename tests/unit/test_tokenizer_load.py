"""A Hugging Face directory's tokenizer loaded without AutoTokenizer (jaxstream/model_files.py's
`names_generic_tokenizer`) is AutoTokenizer's: the same class, vocabulary, special tokens, ids, decoded
text and chat prompt, on each served family's tokenizer as tests/pipeline/family_stacks.py makes it
(SmolLM2's with the family's markers and template, GPT-OSS's o200k) and on the bundled GGUF's."""

from __future__ import annotations

import json

import pytest

from jaxstream.config import ModelConfig
from jaxstream.model_files import GENERIC_TOKENIZER_MODEL_TYPES, _from_hf_dir, load_tokenizer, names_generic_tokenizer
from tests.pipeline import family_stacks

transformers = pytest.importorskip("transformers")

TEXT = "Hello, Paris! <think>x</think> [INST] é 日本語  \n\t 12345 <|im_end|> <tool_call> <start_of_turn>"


def model_type(family: family_stacks.Family) -> str:
    return getattr(transformers, family.config_class or f"{family.transformers}Config").model_type


def assert_same(path, messages=({"role": "user", "content": "Hi"},)) -> None:
    """The fast path is taken for `path` and gives AutoTokenizer's tokenizer."""
    assert names_generic_tokenizer(path)
    ours, auto = _from_hf_dir(path).tokenizer, transformers.AutoTokenizer.from_pretrained(str(path))
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab() and len(ours) == len(auto)
    assert ours.special_tokens_map == auto.special_tokens_map and ours.all_special_ids == auto.all_special_ids
    markers = " ".join(t.content for t in auto.added_tokens_decoder.values())
    for text in (TEXT, TEXT + markers):
        for special in (True, False):
            ids = auto.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
    if auto.chat_template:
        prompt = auto.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        assert ours.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False) == prompt


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return family_stacks.smollm2_tokenizer(tmp_path_factory.mktemp("smollm2"))


def test_the_listed_model_types_keep_a_generic_class():
    """AutoTokenizer swaps a named generic class for the model type's own for the types it lists
    (qwen2's); none of those may be on the fast path's list."""
    from transformers.models.auto import tokenization_auto

    assert not GENERIC_TOKENIZER_MODEL_TYPES & tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    assert "qwen2" in tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS


@pytest.mark.parametrize("name", [n for n in family_stacks.FAMILIES if n != "qwen2"])
def test_each_family_tokenizer_the_same_without_auto_tokenizer(name, smollm2, tmp_path):
    family = family_stacks.FAMILIES[name]
    if family.harmony:
        from jaxstream import harmony

        if harmony.vocabulary_dir() is None:
            pytest.skip("openai-harmony's o200k vocabulary is not here (the test extra)")
        family_stacks.harmony_vocabulary(tmp_path)
    else:
        family_stacks.smollm2_vocabulary(family, smollm2, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type(family)}))
    assert_same(tmp_path)


def test_qwen2_and_unnamed_directories_go_through_auto_tokenizer(smollm2, tmp_path):
    """Where AutoTokenizer's choice depends on more than the named class, the fast path is not taken."""
    family_stacks.smollm2_vocabulary(family_stacks.FAMILIES["qwen2"], smollm2, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert not names_generic_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert names_generic_tokenizer(tmp_path)
    (tmp_path / "tekken.json").write_text("{}")
    assert not names_generic_tokenizer(tmp_path)
    (tmp_path / "tekken.json").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "Qwen2Tokenizer"}))
    assert not names_generic_tokenizer(tmp_path)
    (tmp_path / "config.json").unlink()
    assert not names_generic_tokenizer(tmp_path)


def test_the_bundled_gguf_tokenizer_the_same_from_its_directory(smollm2):
    """SmolLM2's GGUF tokenizer, saved as a directory (a Llama's), loads on the fast path to the same ids."""
    (smollm2 / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert_same(smollm2)
    gguf = load_tokenizer(ModelConfig()).tokenizer
    ours = _from_hf_dir(smollm2).tokenizer
    for special in (True, False):
        ids = gguf.encode(TEXT, add_special_tokens=special)
        assert ours.encode(TEXT, add_special_tokens=special) == ids
        assert ours.decode(ids) == gguf.decode(ids)
