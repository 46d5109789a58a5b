"""Hugging Face transformers' `generate` as the batch baseline of benchmarks/compare_cpu.py, run by it
in a subprocess (so torch's threads and memory stay out of the servers' way):

    python benchmarks/hf_generate.py GGUF --batch 32 --input-len 128 --output-len 128 --rounds 3

The model read from the GGUF (transformers dequantizes it to float32), two threads, greedy. Each
round: `--batch` prompts of exactly `--input-len` token ids (the bench's synthetic ids, so every row
has the same length and needs no padding), `max_new_tokens = min_new_tokens = --output-len`, timed
around `generate` alone, after one untimed warm-up call. Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stack.bench import load  # noqa: E402

THREADS = 2
ROUND_KEY = 1 << 21  # the prompts' seed key, apart from the bench's (load, round) keys


def prompts(batch: int, input_len: int, output_len: int, seed: int, rnd: int) -> torch.Tensor:
    requests = load.synthetic(batch, input_len, output_len, "ids", load.rng_for(seed, ROUND_KEY, rnd))
    return torch.tensor([r.prompt for r in requests])  # [B, T]


def generate(model, ids: torch.Tensor, output_len: int) -> tuple[float, list[int]]:
    """(seconds, new tokens per row)."""
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=output_len, min_new_tokens=output_len,
                             pad_token_id=model.generation_config.eos_token_id)
    seconds = time.perf_counter() - start
    # A row ends at its first EOS (then pads with EOS); min_new_tokens bans EOS, so this should be output_len.
    new = out[:, ids.shape[1]:]  # [B, L]
    ended = new == model.generation_config.eos_token_id
    return seconds, [int(row.nonzero()[0]) if row.any() else new.shape[1] for row in ended]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name, dtype=torch.float32)
    model.eval()
    warmup = prompts(args.batch, args.input_len, args.output_len, args.seed, args.rounds)  # a round of its own
    generate(model, warmup, args.output_len)
    rounds = []
    for rnd in range(args.rounds):
        ids = prompts(args.batch, args.input_len, args.output_len, args.seed, rnd)
        seconds, new_tokens = generate(model, ids, args.output_len)
        rounds.append({"seconds": seconds, "prompt_tokens": [ids.shape[1]] * ids.shape[0], "output_tokens": new_tokens,
                       "output_throughput": sum(new_tokens) / seconds})
        print(f"hf_generate: round {rnd + 1}/{args.rounds}: {sum(new_tokens)} tokens in {seconds:.1f} s",
              file=sys.stderr, flush=True)
    json.dump({"threads": torch.get_num_threads(), "dtype": str(model.dtype), "rounds": rounds}, sys.stdout)


if __name__ == "__main__":
    main()
