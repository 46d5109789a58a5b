"""The load on the worker engine alone, in this process: no Redis, no HTTP, no other service.

The engine is the one `jaxstream up` would build from the same Hydra overrides (`worker=fake`
gives the fake one), driven by the real scheduler core with the scheduler service's numbers
(`stack.driver`). Each request becomes what the scheduler would receive through the same code
the services run: the sampling parameters parsed by the gateway from the very body a server gets,
the prompt tokenized by the tokenizer service (chat template included), all before the clock starts.

Timing, at the engine loop: a request is sent when it is submitted to the scheduler (the next
plan may take it), or at its arrival time with --request-rate; each token arrives when the step
that sampled it returns (a step samples one token per request, so a chunk is a token). The loop
keeps `concurrency` requests in flight (a finished request is replaced before the next plan), or
submits each at the first turn after its arrival.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict

from jaxstream import protocol
from jaxstream.config import load_config
from jaxstream.preflight import preflight
from jaxstream.heartbeat import as_json
from stack.bench.figures import RequestRecord, Run
from stack.bench.load import Request, Schedule
from stack.bench.served import BenchError
from stack.driver import Driver
from worker_svc.engine_api import StepEngine


class InProcessTarget:
    kind = "in-process"

    def __init__(self, name: str, overrides: list[str], temperature: float, extra: dict) -> None:
        self.name = name
        self.overrides = overrides
        self.cfg = load_config(overrides)  # a ConfigError names the key, before anything runs
        preflight(self.cfg)  # what the model's files refute, and the pool scheduler.kv_cache_memory_gib holds
        self.temperature, self.extra = temperature, extra
        self.engine: StepEngine | None = None
        self.preprocessor = None

    def describe(self) -> dict:
        stats = self.engine.stats() if self.engine is not None else {}
        return {"name": self.name, "kind": self.kind, "overrides": self.overrides, "model": self.cfg.model.name,
                "worker": self.cfg.worker.kind, "scheduler": asdict(self.cfg.scheduler),
                "compiles_after_ready": stats.get("compiles_after_ready")}

    def stats(self) -> dict:
        """The engine's stats, shaped as a server's /stats (only the worker's: no other service runs here)."""
        return {"worker": {self.name: {**as_json(self.engine.facts), **self.engine.stats()}}} if self.engine is not None else {}

    def prepare(self, probe: Request, warmup: list[Request]) -> None:
        """Load the tokenizer, build the engine (weights, KV cache, every step shape compiled), warm up."""
        from jaxstream.model_files import load_tokenizer
        from tokenizer_svc.preprocess import Preprocessor

        cfg = self.cfg
        info = load_tokenizer(cfg.model)
        self.preprocessor = Preprocessor(info, cfg.model.max_model_len)
        if cfg.worker.kind == "fake":
            from worker_svc.fake import FakeEngine

            self.engine = FakeEngine(cfg.scheduler.num_pages, cfg.scheduler.page_size, info.vocab_size, cfg.worker.step_delay_ms)
        else:
            from worker_svc.start import build_engine

            self.engine = build_engine(cfg)
        checked = self._tokenized(0, probe)
        if isinstance(checked, str):
            raise BenchError(f"the in-process engine refuses the benchmark's request: {checked}")
        if warmup:
            self.run(warmup, Schedule(concurrency=len(warmup)), 0, -1)

    def run(self, requests: list[Request], schedule: Schedule, load: float, round_: int) -> Run:
        driver = Driver.for_config(self.engine, self.cfg.scheduler, keep_steps=False)
        tokenized = [self._tokenized(i, r) for i, r in enumerate(requests)]
        records = [RequestRecord(0.0, error=t) if isinstance(t, str) else RequestRecord(0.0) for t in tokenized]
        waiting = deque(i for i, t in enumerate(tokenized) if not isinstance(t, str))
        active: dict[str, tuple[int, float, list[float]]] = {}  # rid -> (index, sent, token times)
        seen_rejections = 0
        started = end = time.perf_counter()

        def close(rid: str, error: str | None = None) -> None:
            nonlocal end
            i, sent, times = active.pop(rid)
            r = records[i]
            if error or not times:  # refused, or ended without a token (outgrew the KV pool before its first)
                r.error = error or "ended without a token"
                return
            end = max(end, times[-1])
            r.ttft_s, r.e2e_s = times[0] - sent, times[-1] - sent
            r.itl_s = [b - a for a, b in zip(times, times[1:])]
            r.chunks = r.output_tokens = len(times)
            r.prompt_tokens, r.usage = len(tokenized[i].input_ids), True

        while waiting or active:
            driver.take()  # the last step's result: a request that finished leaves the scheduler
            for rejected in driver.rejected[seen_rejections:]:
                close(rejected.rid, f"rejected ({rejected.status}): {rejected.message}")
            seen_rejections = len(driver.rejected)
            held = driver.held()
            for rid in [rid for rid in active if rid not in held]:
                close(rid)
            now = time.perf_counter()
            while waiting and (len(active) < schedule.concurrency if schedule.arrivals is None
                               else schedule.arrivals[waiting[0]] <= now - started):
                i = waiting.popleft()
                driver.submit(tokenized[i])
                # Sent on arrival, though the loop notices it only after the step then running.
                sent = now if schedule.arrivals is None else started + schedule.arrivals[i]
                active[tokenized[i].rid] = (i, sent, [])
                records[i].start_s = sent - started
            if not active:
                if waiting:  # the next arrival is still to come
                    time.sleep(max(0.0, started + schedule.arrivals[waiting[0]] - time.perf_counter()))
                continue
            result = driver.step()
            now = time.perf_counter()
            if result is None:
                if len(driver.rejected) == seen_rejections:
                    raise BenchError(f"the scheduler planned nothing while {len(active)} requests were held")
                continue
            for rid in result.rids:
                if rid in active:  # else it ended on the token before (overlap computed one more)
                    active[rid][2].append(now)
        return Run(self.name, load, round_, end - started, records)

    def _tokenized(self, i: int, request: Request) -> protocol.TokenizedRequest | str:
        """What the scheduler would receive for this request, or why a server would refuse it."""
        from gateway.errors import ApiError
        from gateway.params import sampling_params

        body = request.body(self.temperature, self.extra)
        try:
            sampling = sampling_params(body, body.get("max_tokens"), mode_default=self.cfg.server.logprobs_mode)
        except ApiError as exc:
            return f"HTTP {exc.status}: {exc.message}"
        prompt: dict = {}
        if request.chat:
            prompt["messages"] = tuple(protocol.ChatMessage(role, content) for role, content in request.messages)
        elif isinstance(request.prompt, str):
            prompt["text"] = request.prompt
        else:
            prompt["input_ids"] = tuple(request.prompt)
        reply = self.preprocessor(protocol.GenerateRequest(f"bench-{i}", "bench", sampling, **prompt))
        if isinstance(reply, protocol.RequestRejected):
            return f"HTTP {reply.status}: {reply.message}"
        return reply
