"""The documents, checked: measured figures live in docs/performance.md alone, and links resolve.

1. A measured figure is a speed ratio (`1.26x`), a rate (`259.5 output tok/s`, `61.4 GB/s`,
   `12 req/s`), a timing (`14.3 ms`, `809 s`, `975-1046 s`), a percentage (`45% more`) or a
   numerical deviation (`2.5e-6`). README.md and docs/design.md state none: they say "measured in
   docs/performance.md", which holds each with its date, commit and command.
2. Configuration values are no figures: sizes and limits (`32 MiB`, `2 MB pages`), versions
   (`Python >= 3.11`, `Redis >= 6.2`, `jax 0.10.2`), mesh shapes (`2 x 2`), HTTP statuses (`400s`).
   The patterns leave them alone; a duration that is a setting (`redis.heartbeat_ttl_ms`, 10 s) is
   named in ALLOWED with the reason it is one.
3. Every relative link in README.md, CONTRIBUTING.md and docs/*.md names a file that exists, and
   its #anchor a heading of that file (GitHub's slugs).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README, DESIGN = ROOT / "README.md", ROOT / "docs" / "design.md"
DOCUMENTS = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]

NUMBER = r"(?<![\w.])~?\d+(?:[.,]\d+)*"
RANGE = rf"{NUMBER}(?:\s*(?:-|to|and|/)\s*~?\d+(?:\.\d+)?)?"
FIGURES = {
    "speed ratio": re.compile(rf"{NUMBER}x(?!\w)"),
    "rate": re.compile(rf"{NUMBER}\s*(?:output\s+)?(?:tok|tokens|GB|MB|KB|req|requests|GFLOP|TFLOP|steps)/s\b"
                       rf"|{NUMBER}\s*GFLOPS\b"),
    # "s" only after a space: "400s" are statuses, "809 s" a time.
    "timing": re.compile(rf"{RANGE}(?:\s*(?:ms|us|µs)|\s+(?:s|seconds|minutes|min))(?![\w/])"),
    "percentage": re.compile(rf"{NUMBER}\s?%"),
    "deviation": re.compile(r"(?<![\w.])\d(?:\.\d+)?e-\d+\b"),
}
# Durations that are settings or stated budgets, not measurements: (pattern around the figure, why).
ALLOWED = (
    (re.compile(r"heartbeat_ttl_ms`?,\s*10 s"), "redis.heartbeat_ttl_ms's default"),
    (re.compile(r"drain_timeout_s`?,?\s*\(?30 s"), "server.drain_timeout_s's default"),
    (re.compile(r"health_generate_timeout_s`?,?\s*\(?20 s"), "server.health_generate_timeout_s's default"),
    (re.compile(r"\(0\.5, 1, 2, 4, 8 s\)"), "the supervisor's restart back-off schedule (stack/supervisor.py)"),
    (re.compile(r"every 30 s while it lasts"), "how often an outage is logged (transport.Outage)"),
    (re.compile(r"under 15 minutes"), "the suite's time budget, a requirement"),
)


def figures(text: str, name: str) -> list[str]:
    """Each measured figure in `text` as "name:line: the figure (kind)", allowed settings left out."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        allowed = [m.span() for pattern, _ in ALLOWED for m in pattern.finditer(line)]
        for kind, pattern in FIGURES.items():
            for m in pattern.finditer(line):
                if not any(start <= m.start() and m.end() <= end for start, end in allowed):
                    found.append(f"{name}:{number}: {m.group(0).strip()!r} ({kind})")
    return found


def test_the_readme_states_no_measured_figure():
    found = figures(README.read_text(), "README.md")
    assert not found, "measured figures belong in docs/performance.md:\n" + "\n".join(found)


def test_the_design_map_states_no_measured_figure():
    found = figures(DESIGN.read_text(), "docs/design.md")
    assert not found, "measured figures belong in docs/performance.md:\n" + "\n".join(found)


@pytest.mark.parametrize("text", [
    "decode of 32 streams 1.26x faster", "2.1x on copying a passage", "~1.2x at batch 1", "1.02-1.06x faster",
    "259.5 output tok/s", "61.4 GB/s", "12 req/s", "229.1 GFLOP/s", "~120 GFLOPS",
    "14.3 ms", "a 3000-token prompt in 5.3 s", "it took 809 s", "42 s", "975-1046 s", "4 to 5 s", "~150 s of CPU",
    "45% more start-up compile time", "+1-3 % step time", "logprobs within 2.5e-6", "7e-8 of a float32 head's",
])
def test_a_measured_figure_is_found(text):
    assert figures(text, "t"), text


@pytest.mark.parametrize("text", [
    "a body over `server.max_body_bytes` (32 MiB)", "keys of at most 16 MiB", "weights on 2 MB pages, 4 KB ones",
    "Python >= 3.11", "Redis >= 6.2", "jax 0.10.2", "docker-compose 1.29", "CUDA 12", "PROTOCOL_VERSION 13",
    "`tp2_ep2`: 4 devices (2 x 2)", "732 200s, 1,946 400s", "x86-64", "0x7f", "scheduler.page_size=32",
    "heads 4, 16 layers", "`redis.heartbeat_ttl_ms`, 10 s, long enough", "Restarts back off (0.5, 1, 2, 4, 8 s)",
    "the suite runs in under 15 minutes", "Llama-3.1-8B-Instruct", "Qwen3-30B-A3B", "±(2^53 - 1)",
])
def test_a_configuration_value_is_no_figure(text):
    assert not figures(text, "t"), figures(text, "t")


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)  # no headings inside code
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+)$", text, flags=re.M)}


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_and_a_heading(document):
    broken = []
    for target in LINK.findall(document.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s):, mailto:
        file, _, anchor = target.partition("#")
        path = (document.parent / file).resolve() if file else document
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, f"{document.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_journal_is_linked_from_performance_and_says_it_is_append_only():
    assert "journal.md" in (ROOT / "docs" / "performance.md").read_text()
    assert "append-only" in (ROOT / "docs" / "journal.md").read_text().split("\n\n", 2)[1].lower()


def test_the_readme_is_a_five_minute_read():
    assert len(README.read_text().splitlines()) <= 150
