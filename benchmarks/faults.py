"""Faults under load on a live stack, as an operator meets them: each service killed, and the
scheduler and the detokenizer frozen, while streams run; how long until the stack answers again,
and what became of the streams.

    python benchmarks/faults.py [--streams 8] [--frozen-streams 16] [--stops 8,20] [overrides...]

Starts `jaxstream up` with the overrides (the README's stack, real model, by default), then:
1. for each service (tokenizer, scheduler, worker, detokenizer, gateway): `--streams` streaming
   /generate requests of 200 greedy tokens run; 2 s in, the service gets SIGKILL; a chat is sent
   every 0.2 s until one is answered: the seconds from the kill to that answer, and each stream's
   end (whole, a clean SSE error, a cut connection: the gateway's own, or a rewritten prefix);
2. for the scheduler and the detokenizer, each `--stops` length: `--frozen-streams` streams run,
   the service gets SIGSTOP for that long, then SIGCONT: the seconds from SIGCONT to the next
   answer, and each stream's end, a whole one compared with the same request sent alone first
   (greedy; "diverged" names the position, "REORDER" when the tokens are the alone run's in
   another order: the defect a lost read made).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stack.bench.stacks import jaxstream_up, service_pid  # noqa: E402

SERVICES = ("tokenizer_svc", "scheduler_svc", "worker_svc", "detokenizer_svc", "gateway")
TOKENS = 200
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12, "temperature": 0}


def answered_after(url: str, deadline_s: float = 180) -> tuple[float | None, str]:
    """Seconds until a chat is answered (one every 0.2 s), and its text."""
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        try:
            r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30)
            if r.status_code == 200:
                return time.monotonic() - started, r.json()["choices"][0]["message"]["content"]
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return None, ""


def body(i: int, stream: bool) -> dict:
    return {"input_ids": [1, 504 + i], "stream": stream,
            "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True, "temperature": 0}}


def stream(url: str, i: int) -> tuple[str, list[int]]:
    """('whole' | 'error' | 'cut' | 'rewrote' | 'status N', the tokens received)."""
    ids: list[int] = []
    failed = False
    try:
        with httpx.stream("POST", url + "/generate", json=body(i, True), timeout=240) as r:
            if r.status_code != 200:
                return f"status {r.status_code}", ids
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    failed = True
                elif event["output_ids"][: len(ids)] != ids:
                    return "rewrote", ids
                else:
                    ids = event["output_ids"]
    except httpx.HTTPError:
        return "cut", ids
    return ("error" if failed else "whole" if len(ids) == TOKENS else "short"), ids


def under_load(url: str, count: int, fault) -> tuple[dict[int, tuple[str, list[int]]], float | None]:
    """Run `count` streams, apply `fault` 2 s in; (each stream's end, seconds to the next answer)."""
    ends: dict[int, tuple[str, list[int]]] = {}
    threads = [threading.Thread(target=lambda i=i: ends.__setitem__(i, stream(url, i))) for i in range(count)]
    for t in threads:
        t.start()
    time.sleep(2)
    fault()
    took, _ = answered_after(url)
    for t in threads:
        t.join(300)
    return ends, took


def tally(ends: dict[int, tuple[str, list[int]]], alone: dict[int, list[int]] | None = None) -> str:
    kinds: dict[str, int] = {}
    for i, (end, ids) in sorted(ends.items()):
        if end == "whole" and alone is not None and ids != alone[i]:
            at = next(k for k, (a, b) in enumerate(zip(ids, alone[i])) if a != b)
            end = f"whole, diverged at {at}" + (" (a REORDER)" if sorted(ids) == sorted(alone[i]) else "")
        elif end == "whole" and alone is not None:
            end = "whole, as alone"
        kinds[end] = kinds.get(end, 0) + 1
    return ", ".join(f"{n} {kind}" for kind, n in kinds.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8, help="streams running while a service is killed")
    parser.add_argument("--frozen-streams", type=int, default=16, help="streams running while a service is frozen")
    parser.add_argument("--stops", default="8,20", help="seconds of each SIGSTOP, comma-separated")
    parser.add_argument("overrides", nargs="*", help="for jaxstream up")
    args = parser.parse_args()
    stops = [float(s) for s in args.stops.split(",") if s]
    with jaxstream_up(args.overrides) as url:
        took, text = answered_after(url)
        print(f"# jaxstream up {' '.join(args.overrides) or '(defaults)'}: first answer {text!r}", flush=True)
        for module in SERVICES:
            ends, took = under_load(url, args.streams, lambda m=module: os.kill(service_pid(url, m), signal.SIGKILL))
            print(f"SIGKILL {module:16} answered again {took:.1f} s after; streams: {tally(ends)}", flush=True)
            time.sleep(3)
        alone = {i: httpx.post(url + "/generate", json=body(i, False), timeout=120).json()["output_ids"]
                 for i in range(args.frozen_streams)}
        for module in ("scheduler_svc", "detokenizer_svc"):
            for seconds in stops:
                def freeze(m: str = module, s: float = seconds) -> None:
                    pid = service_pid(url, m)
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(s)
                    os.kill(pid, signal.SIGCONT)
                ends, took = under_load(url, args.frozen_streams, freeze)
                print(f"SIGSTOP {module:16} {seconds:g} s: answered {took:.1f} s after SIGCONT; streams: {tally(ends, alone)}",
                      flush=True)
                time.sleep(3)


if __name__ == "__main__":
    main()
