"""Session fixtures for model tests (`smollm2_checkpoint` and `hf_smollm2` live in tests/conftest.py,
where the pipeline tests reach them too)."""

import json

import pytest

from tests import background


@pytest.fixture(scope="session")
def smollm2_hf_dir(hf_smollm2, tmp_path_factory):
    """`hf_smollm2` saved as a Hugging Face directory, sharded (several files and an index)."""
    out = tmp_path_factory.mktemp("smollm2_hf")
    # transformers refuses to save a model loaded through its GGUF quantizer; its weights are plain
    # float32 by now, so save them without it.
    quantizer, hf_smollm2.hf_quantizer = hf_smollm2.hf_quantizer, None
    try:
        hf_smollm2.save_pretrained(out, max_shard_size="100MB")
    finally:
        hf_smollm2.hf_quantizer = quantizer
    # Nor is the saved directory a GGUF: drop the note, so from_pretrained(out) reads it as float32.
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="session")
def gpt_oss_sharded_runs():
    """GPT-OSS's sharded runs (tests/model/gpt_oss_tp.py), started at the session's start (tests/conftest.py)."""
    return background.runs()


@pytest.fixture(scope="session")
def lora_sharded_runs():
    """LoRA adapters under tp2 (tests/model/lora_tp.py), started at the session's start (tests/conftest.py)."""
    return background.runs()


@pytest.fixture(scope="session")
def deepseek_sharded_runs():
    """DeepSeek's sharded and batch_invariant runs (tests/model/deepseek_tp.py), started at the session's start."""
    return background.runs()


@pytest.fixture(scope="session")
def hybrid_sharded_runs():
    """The hybrids' sharded and batch_invariant runs (tests/model/hybrid_tp.py), started at the session's start."""
    return background.runs()
