"""What the parity tests of small random models share: the step shapes, the prompts (one longer
than two steps' budget, so it is prefilled beside the others' decode), and weights redrawn so
that logits and routing are not flat."""

import json
import re

import numpy as np
import pytest

from worker_svc.batch import Buckets

PAGE_SIZE, NUM_PAGES = 8, 64
BUDGET = 32  # tokens per step: the 75-token prompt takes three steps, beside the others' decode
BUCKETS = Buckets(tokens=(4, 32), pairs=(0, 64, 256), max_rows=4, max_pages=16)
NEW_TOKENS = 32
PROMPT_LENGTHS = (75, 6, 19)


def random_prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, n).tolist() for n in PROMPT_LENGTHS]


def redraw(model):
    """transformers' default initializer (std 0.02, norms all ones) gives nearly flat logits and
    leaves the norms untested: each matrix ~ N(0, 1/fan_in) (its last axis is the input), the
    embedding N(0, 1), every norm its own scales. Returns the model, float32, in eval mode."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() >= 2 and "embed" not in name else 1.0)
    return model.float().eval()


def assert_refused(directory, config: dict, model: str, message: str) -> None:
    """A Hugging Face directory with `config` (and a token tensor) fails to load with a
    CheckpointError naming the directory and `model`, then, somewhere after, `message`."""
    from safetensors.numpy import save_file

    from worker_svc.loading import load_model
    from worker_svc.weights import CheckpointError, open_checkpoint

    (directory / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": np.zeros((2, 2), np.float32)}, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape(f"{directory}: {model}") + ".*" + re.escape(message)):
        load_model(open_checkpoint(directory), progress=False)
