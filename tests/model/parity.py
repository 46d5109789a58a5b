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


# The checks every family's test module makes the same way (test_families.py, test_gemma.py, test_gpt_oss.py).


def run_with_a_prefix_hit(engine, requests: list[tuple[str, list[int]]], sampling) -> dict:
    """{rid: trace} of `requests` (gpt_oss_tp.parity_requests') through the real scheduler core: all but the
    last together (a long prompt's chunked prefill beside the others' decode), then the last, whose first
    pages are a prefix-cache hit."""
    from tests.worker.driver import Driver

    driver = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=BUDGET, max_running=4, keep_logits=True, prefix_cache=True)
    traces = driver.run([(rid, prompt, sampling) for rid, prompt in requests[:-1]])
    assert any(len(s.seqs) > 1 and s.seqs[-1].num_tokens > 1 for s in driver.steps)  # prefill beside decode
    traces |= driver.run([(rid, prompt, sampling) for rid, prompt in requests[-1:]])
    first = next(s.seqs[0] for s in driver.steps if s.seqs[0].rid == requests[-1][0])
    assert first.context_len - first.num_tokens >= 6 * PAGE_SIZE  # fed after a cache hit of whole pages
    return traces


def assert_weights_read_back(engine, directory) -> None:
    """Every mapping transform's inverse (TO_HF): the engine's parameters read back by Hugging Face name are
    the checkpoint's tensors in `directory`, bit for bit (what a trainer's push by name and /list_weights see)."""
    from flax import nnx
    from safetensors.numpy import load_file

    from worker_svc.hf_index import hf_tensors

    saved = load_file(str(directory / "model.safetensors"))
    ours = dict(hf_tensors(nnx.merge(engine.graph, engine.params)))
    assert ours.keys() == saved.keys()
    for name, tensor in saved.items():
        np.testing.assert_array_equal(ours[name], tensor, err_msg=name)


def assert_routed_experts_are_transformers(hf, engines: dict, router: str, vocab: int, top_k: int, as_sets: bool = False) -> None:
    """Each engine's routed experts (R3) for a greedy request are the experts transformers' router (each
    layer's `mlp.<router>`, whose third output is the chosen indices) picks at every position that ran.
    `as_sets`: each token's experts compared as a set (a router whose torch.topk is unsorted: DeepSeek's).
    A dense layer (no `mlp.<router>`) routes to none: ours are zeros there, as SGLang's."""
    import torch

    from jaxstream import protocol
    from tests.model.test_routed_experts import gathered
    from tests.worker.driver import Driver

    prompt = random_prompts(vocab)[0]
    asks = protocol.SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    picked = {}
    hooks = [getattr(layer.mlp, router).register_forward_hook(lambda m, i, out, at=at: picked.__setitem__(at, out[2].numpy()))
             for at, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, router)]
    try:
        for strategy, engine in engines.items():
            trace = Driver(engine, PAGE_SIZE, NUM_PAGES, budget=BUDGET, max_running=4).run([("x", prompt, asks)])["x"]
            first, ours = gathered(trace)
            with torch.no_grad():
                hf(torch.tensor([prompt + trace.tokens[:-1]]))  # every position that ran (the last token never did)
            dense = np.zeros((len(prompt) + len(trace.tokens) - 1, top_k), np.int32)
            theirs = np.stack([picked.get(at, dense) for at in range(len(hf.model.layers))], axis=1)  # [T, L, k]
            assert first == 0 and ours.shape == (len(prompt) + asks.max_new_tokens - 1, len(hf.model.layers), top_k)
            if as_sets:
                ours, theirs = np.sort(ours, axis=-1), np.sort(theirs, axis=-1)
            np.testing.assert_array_equal(ours, theirs, err_msg=strategy)
    finally:
        for hook in hooks:
            hook.remove()


def assert_int8_follows(what: str, hf, model, tokens: np.ndarray) -> None:
    """`model` (loaded under worker.quantization=int8) in one prefill forward against transformers' float32
    logits: within quantization error, the same argmax nearly everywhere. Prints the figure (-rP)."""
    import torch

    from tests.worker.test_quantization import forward

    int8 = forward(model, tokens)
    with torch.no_grad():
        exact = hf(torch.tensor([tokens.tolist()])).logits[0].numpy()
    per_token = np.abs(int8 - exact).max(-1)
    print(f"{what} int8: max |logit diff| per token, median {np.median(per_token):.3f}, max {per_token.max():.3f} "
          f"(logit std {exact.std():.2f})")
    assert np.median(per_token) < 0.1 * exact.std() and per_token.max() < 0.5 * exact.std(), per_token
    assert (int8.argmax(-1) == exact.argmax(-1)).mean() >= 0.9
