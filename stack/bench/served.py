"""A server loaded over HTTP: streaming /v1/completions (or /v1/chat/completions) with
stream_options.include_usage, as vLLM's and SGLang's serving benchmarks send them.

A content chunk is a streamed choice carrying text (completions' `text`, chat's `delta.content` or
`delta.reasoning_content`), or a token whose text is empty (a special token, a held-back partial
character): an empty text in a chunk that neither opens the chat message (`role`) nor finishes
(`finish_reason`). The usage chunk, the role chunk and a bare finish chunk are not content. A
request's text is its content chunks' texts, joined.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from urllib.parse import urlsplit

from jaxstream.keys import API_KEY_ENV
from stack.bench.figures import RequestRecord, Run
from stack.bench.load import EXACT_LENGTH, Request, Schedule


class BenchError(Exception):
    """The benchmark cannot go on (a server unreachable or refusing the load); the message says why."""


def _httpx():
    try:
        import httpx
    except ImportError:
        raise BenchError("loading a server needs httpx: pip install httpx (or 'jaxstream[bench]')") from None
    return httpx


class ServedTarget:
    kind = "http"

    def __init__(self, name: str, url: str, model: str | None, temperature: float, extra: dict, timeout: float,
                 overrides: list[str] | None = None) -> None:
        self.name, self.url = name, url
        self.overrides = overrides  # a stack bench started (--serve): its `jaxstream up` overrides
        self.model = model
        self.temperature, self.extra, self.timeout = temperature, extra, timeout
        self.extensions = tuple(k for k in EXACT_LENGTH if k not in extra)  # an explicit extra field wins
        self.refused: list[str] = []  # extensions the server refused (sent without them)

    def describe(self) -> dict:
        served = {} if self.overrides is None else {"overrides": self.overrides}
        return {"name": self.name, "kind": self.kind, "url": self.url, **served, "model": self.model,
                "extensions_sent": list(self.extensions), "extensions_refused": self.refused}

    def prepare(self, probe: Request, warmup: list[Request]) -> None:
        """Find the model, check that the server takes the load (dropping a refused extension), warm it up."""
        asyncio.run(self._prepare(probe, warmup))

    def run(self, requests: list[Request], schedule: Schedule, load: float, round_: int) -> Run:
        return asyncio.run(self._run(requests, schedule, load, round_))

    def stats(self) -> dict:
        return server_stats(self.url, self.timeout)

    # --

    def _client(self, connections: int):
        httpx = _httpx()
        return httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(self.timeout), headers=auth_headers(),
                                 limits=httpx.Limits(max_connections=connections + 4, max_keepalive_connections=connections + 4))

    def _body(self, request: Request) -> tuple[str, dict]:
        body = request.body(self.temperature, self.extra, self.extensions)
        body.update(model=self.model, stream=True, stream_options={"include_usage": True})
        return ("/v1/chat/completions" if request.chat else "/v1/completions"), body

    async def _prepare(self, probe: Request, warmup: list[Request]) -> None:
        httpx = _httpx()
        async with self._client(max(len(warmup), 1)) as client:
            try:
                if self.model is None:
                    r = await client.get("/v1/models")
                    if r.status_code == 401:
                        raise BenchError(f"{self.url} wants an API key: set ${API_KEY_ENV} (sent as 'Authorization: Bearer')")
                    r.raise_for_status()
                    self.model = r.json()["data"][0]["id"]
            except httpx.HTTPError as exc:
                raise BenchError(f"cannot reach {self.url}/v1/models: {describe_error(exc)} (is a server running there?)") from None
            except (ValueError, KeyError, IndexError, TypeError):
                raise BenchError(f"{self.url}/v1/models did not list a model; pass --model") from None
            while True:
                record = await self._one(client, probe, time.perf_counter())
                refused = next((k for k in self.extensions if (record.error or "").startswith("HTTP 4") and k in record.error), None)
                if refused is None:
                    break
                self.extensions = tuple(k for k in self.extensions if k != refused)
                self.refused.append(refused)
            if record.error:
                raise BenchError(f"{self.url} refused the benchmark's request: {record.error}")
            await asyncio.gather(*(self._one(client, r, time.perf_counter()) for r in warmup))

    async def _run(self, requests: list[Request], schedule: Schedule, load: float, round_: int) -> Run:
        in_flight = schedule.concurrency or len(requests)
        async with self._client(in_flight) as client:
            gate = asyncio.Semaphore(in_flight)
            started = time.perf_counter()

            async def send(i: int, request: Request) -> RequestRecord:
                if schedule.arrivals is not None:
                    await asyncio.sleep(max(0.0, started + schedule.arrivals[i] - time.perf_counter()))
                async with gate:
                    return await self._one(client, request, started)

            records = await asyncio.gather(*(send(i, r) for i, r in enumerate(requests)))
            duration = time.perf_counter() - started
        return Run(self.name, load, round_, duration, list(records))

    async def _one(self, client, request: Request, run_start: float) -> RequestRecord:
        httpx = _httpx()
        path, body = self._body(request)
        sent = time.perf_counter()
        record = RequestRecord(start_s=sent - run_start)
        arrivals: list[float] = []
        texts: list[str] = []
        usage = None
        try:
            async with client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    record.error = f"HTTP {response.status_code}: {error_message(text)}"
                    return record
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        record.error = f"error event: {error_message(data)}"
                        break
                    usage = chunk.get("usage") or usage
                    text = content(chunk)
                    if text is not None:
                        arrivals.append(now)
                        texts.append(text)
        except httpx.HTTPError as exc:
            record.error = describe_error(exc)
        except json.JSONDecodeError as exc:
            record.error = f"a stream event is not JSON: {exc}"
        if record.error:
            return record
        record.e2e_s = time.perf_counter() - sent
        record.chunks = len(arrivals)
        record.text = "".join(texts)
        record.ttft_s = arrivals[0] - sent if arrivals else None
        record.itl_s = [b - a for a, b in zip(arrivals, arrivals[1:])]
        record.usage = isinstance(usage, dict) and "completion_tokens" in usage
        record.output_tokens = int(usage["completion_tokens"]) if record.usage else len(arrivals)
        record.prompt_tokens = int(usage.get("prompt_tokens") or 0) if record.usage else request.input_len
        return record


def content(chunk: dict) -> str | None:
    """The text of a content chunk ('' for a token without text); None for a chunk that is not content."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        if delta is not None:  # chat
            text = delta.get("content") or delta.get("reasoning_content")
            opening = "role" in delta
            empty = delta.get("content") == ""
        else:
            text, opening, empty = choice.get("text"), False, choice.get("text") == ""
        if text or (empty and not opening and choice.get("finish_reason") is None):
            return text or ""
    return None


def server_stats(url: str, timeout: float = 10.0) -> dict:
    """A server's /stats (jaxstream's: {role: {instance: {key: value}}}); {} where it has none."""
    httpx = _httpx()
    try:
        response = httpx.get(url + "/stats", headers=auth_headers(), timeout=timeout)
        stats = response.json() if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}
    return stats if isinstance(stats, dict) else {}


def auth_headers() -> dict[str, str]:
    """The variable the server reads its user key from: set once, it serves both sides."""
    key = os.environ.get(API_KEY_ENV, "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


def error_message(text: str) -> str:
    """The message of an OpenAI-shaped error body, else the body itself, shortened."""
    try:
        error = json.loads(text)["error"]
        message = error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        message = text
    return message.strip()[:300]


def describe_error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def target_names(urls: list[str]) -> list[str]:
    """host:port[/path] of each URL; the same URL twice is told apart by a suffix (#2)."""
    return distinct([urlsplit(url).netloc + urlsplit(url).path for url in urls])


def distinct(names: list[str]) -> list[str]:
    """The names, a repeated one told apart by a suffix (#2, #3, ...)."""
    out: list[str] = []
    for name in names:
        count = sum(n == name or n.startswith(name + " #") for n in out)
        out.append(f"{name} #{count + 1}" if count else name)
    return out
