"""The results: a plain-text table, a JSON file with every figure and every request, a PNG plot."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from stack.bench.figures import PERCENTILES, Row, Run, figures

LATENCY_COLUMNS = (("ttft", "TTFT ms"), ("itl", "ITL ms"), ("e2e", "E2E ms"))


def _num(value: float | None, width: int, digits: int = 1) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def load_label(mode: str) -> str:
    return "conc" if mode == "concurrency" else "rate"


def load_text(value: float) -> str:
    return f"{value:g}"


def table(rows: list[Row], mode: str, with_ratio: bool) -> str:
    name_width = max([len(r.target) for r in rows] + [6])
    lead = f"{'target':<{name_width}} {load_label(mode):>5} {'reqs':>7} {'out tok/s':>10} {'total tok/s':>11}"
    groups = "".join(f" {title + ' p50 / p90 / p99':>{3 * 8}}" for _, title in LATENCY_COLUMNS)
    header = lead + groups + (f" {'ratio':>6}" if with_ratio else "")
    lines = [header]
    for row in rows:
        f = row.figures
        done, total = f["completed"], f["requests"]
        reqs = f"{done:g}" if done == total else f"{done:g}/{total:g}"
        line = (f"{row.target:<{name_width}} {load_text(row.load):>5} {reqs:>7} {_num(f['output_throughput'], 10)}"
                f" {_num(f['total_throughput'], 11)}")
        for key, _ in LATENCY_COLUMNS:
            line += " " + "".join(_num(f[f"{key}_p{p}_ms"], 8) for p in PERCENTILES)
        if with_ratio:
            line += f" {_num(row.ratio, 6, 2)}"
        lines.append(line)
    return "\n".join(lines)


def write_json(path: Path, meta: dict, rows: list[Row], runs: list[Run], taxes: list[dict]) -> None:
    data = {
        **meta,
        "rows": [{"target": r.target, "load": r.load, "rounds": r.rounds, "ratio": r.ratio, **r.figures} for r in rows],
        "pipeline_tax": taxes,
        "runs": [{"target": run.target, "load": run.load, "round": run.round, "figures": figures(run),
                  "requests": [asdict(rec) for rec in run.records]} for run in runs],
    }
    path.write_text(json.dumps(data, indent=1) + "\n")


def plot(path: Path, rows: list[Row], mode: str, title: str) -> None:
    """Throughput and latency (medians, p90 dashed) against the load, a line per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("output_throughput", "output tokens/s", None), ("ttft", "TTFT (ms)", "ttft"),
              ("itl", "ITL (ms)", "itl"), ("e2e", "end-to-end latency (ms)", "e2e"))
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    targets = list(dict.fromkeys(r.target for r in rows))
    loads = sorted({r.load for r in rows})
    for ax, (key, label, latency) in zip(axes.flat, panels):
        for i, target in enumerate(targets):
            mine = sorted((r for r in rows if r.target == target), key=lambda r: r.load)
            xs = [r.load for r in mine]
            color = f"C{i}"
            if latency is None:
                ax.plot(xs, [r.figures[key] for r in mine], "o-", color=color, label=target)
            else:
                ax.plot(xs, [r.figures[f"{latency}_p50_ms"] for r in mine], "o-", color=color, label=f"{target} p50")
                ax.plot(xs, [r.figures[f"{latency}_p90_ms"] for r in mine], "o--", color=color, alpha=0.6, label=f"{target} p90")
        if len(loads) > 1 and loads[-1] / loads[0] >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(loads, [load_text(v) for v in loads])
        ax.set_xlabel("concurrency (requests in flight)" if mode == "concurrency" else "request rate (requests/s)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title, fontsize="medium")
    fig.savefig(path, dpi=100)
    plt.close(fig)
