"""What a run measured, and the figures made of it: per run, then per (target, load) over rounds."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "itl", "tpot", "e2e")


@dataclass
class RequestRecord:
    """One request's timings, in seconds from when it was sent (`start_s`: from the run's start)."""

    start_s: float
    ttft_s: float | None = None  # first content chunk
    e2e_s: float | None = None  # end of the stream
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    prompt_tokens: int | None = None  # the server's usage, else as drawn (None: unknown)
    output_tokens: int = 0  # the server's usage, else the content chunks
    chunks: int = 0  # content chunks received
    usage: bool = False  # the counts came from the server's usage
    text: str | None = None  # the content chunks' texts, joined (served; in process: None, it has tokens only)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e_s is not None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (tokens - 1), vLLM's TPOT."""
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class Run:
    target: str
    load: float  # the concurrency or the request rate
    round: int
    duration_s: float  # first request sent .. last one ended
    records: list[RequestRecord]


def short_outputs(runs: list[Run], target: str, asked: int) -> tuple[int, int]:
    """(completed requests of `target` with fewer than `asked` output tokens, completed requests):
    a server that ignores ignore_eos and min_tokens stops at its end token."""
    done = [r for run in runs if run.target == target for r in run.records if r.ok]
    return sum(1 for r in done if r.output_tokens < asked), len(done)


def figures(run: Run) -> dict[str, float | int | None]:
    """Throughputs over the run's wall time; latency percentiles over its completed requests (ITL
    over every gap of every stream), in milliseconds."""
    done = [r for r in run.records if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in done)
    output = sum(r.output_tokens for r in done)
    seconds = max(run.duration_s, 1e-9)
    out: dict[str, float | int | None] = {
        "requests": len(run.records),
        "completed": len(done),
        "failed": len(run.records) - len(done),
        "duration_s": run.duration_s,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "request_throughput": len(done) / seconds,
        "output_throughput": output / seconds,
        "total_throughput": (prompt + output) / seconds,
    }
    samples = {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "itl": [gap for r in done for gap in r.itl_s],
        "tpot": [t for r in done if (t := r.tpot_s) is not None],
        "e2e": [r.e2e_s for r in done],
    }
    for name in LATENCIES:
        values = np.asarray(samples[name], dtype=np.float64) * 1000
        out[f"{name}_mean_ms"] = float(values.mean()) if values.size else None
        for p in PERCENTILES:
            out[f"{name}_p{p}_ms"] = float(np.percentile(values, p)) if values.size else None
    return out


def median_or_none(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


@dataclass
class Row:
    """A (target, load): each figure the median of its rounds'; `ratio` the median of the rounds'
    output-throughput ratios to the reference target's run of the same round."""

    target: str
    load: float
    rounds: int
    figures: dict[str, float | int | None]
    ratio: float | None = None


def summarize(runs: list[Run], targets: list[str], loads: list[float], reference: str | None) -> list[Row]:
    per_run = {(r.target, r.load, r.round): figures(r) for r in runs}
    rows = []
    for load in loads:
        for target in targets:
            mine = sorted((key[2], f) for key, f in per_run.items() if key[:2] == (target, load))
            if not mine:
                continue
            keys = mine[0][1].keys()
            row = Row(target, load, len(mine), {k: median_or_none([f[k] for _, f in mine]) for k in keys})
            if reference is not None:
                ratios = []
                for rnd, f in mine:
                    ref = per_run.get((reference, load, rnd))
                    if ref and ref["output_throughput"]:
                        ratios.append(f["output_throughput"] / ref["output_throughput"])
                row.ratio = median_or_none(ratios)
            rows.append(row)
    return rows
