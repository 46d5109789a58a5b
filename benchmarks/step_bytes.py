"""Bytes of the scheduler's Step message per decode step, as sent and as version 5 sent it.

Runs the real scheduler core and service with the fake worker in process (stack/driver.py) over
`--streams` concurrent requests with a typical OpenAI client's sampling (temperature, top_p, a stop
string, a seed, max_tokens), and prints the median encoded size of the steps where every request
decodes. "As version 5 sent it" re-encodes the same steps with each seq carrying its request's
SamplingParams and the Step its page_size, which is what protocol version 5 put on the wire.

    python benchmarks/step_bytes.py --streams 32
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxstream import protocol  # noqa: E402
from stack.driver import Driver  # noqa: E402
from worker_svc.fake import FakeEngine  # noqa: E402

PAGE_SIZE = 16


def as_version_5(step: protocol.Step, sampling: dict[str, protocol.SamplingParams]) -> protocol.Step:
    seqs = tuple(msgspec.structs.replace(seq, sampling=sampling[seq.rid]) for seq in step.seqs)
    return msgspec.structs.replace(step, seqs=seqs, page_size=PAGE_SIZE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    engine = FakeEngine(num_pages=4096, page_size=PAGE_SIZE, vocab_size=49152)
    driver = Driver(engine, PAGE_SIZE, 4096, budget=8192, max_running=args.streams, overlap=True)
    sampling = {}
    for i in range(args.streams):
        rid = f"chatcmpl-{i:032x}"
        sampling[rid] = protocol.SamplingParams(max_new_tokens=args.output_len, temperature=0.7, top_p=0.9,
                                                seed=1234 + i, stop=("\n\n",))
        rule = protocol.FinishRule((2,), args.output_len)
        driver.submit(protocol.TokenizedRequest(rid, "gateway.a", tuple(range(1, args.prompt_len + 1)), sampling[rid],
                                                finish=rule))
    while driver.step() is not None:
        pass
    decodes = [s for s in driver.steps if len(s.seqs) == args.streams and all(q.num_tokens == 1 for q in s.seqs)]
    now = [len(protocol.encode(s)) for s in decodes]
    before = [len(protocol.encode(as_version_5(s, sampling))) for s in decodes]
    print(f"{args.streams} streams, {len(decodes)} all-decode steps; bytes per Step message (median)")
    print(f"version {protocol.PROTOCOL_VERSION} (sampling once per admission): {statistics.median(now):8.0f}")
    print(f"version 5 (sampling in every seq, page_size): {statistics.median(before):8.0f}")
    print(f"ratio: {statistics.median(now) / statistics.median(before):.2f}")


if __name__ == "__main__":
    main()
