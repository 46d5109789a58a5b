"""Weights on 2 MB pages (worker_svc/huge_pages.py, worker.huge_pages): the buffers the kernel is
asked about are really on huge pages afterwards (the process's own memory map says so), their values
unchanged; small buffers and the memory around a buffer are left alone; the engine asks at start-up
and again for the buffers a weight update brings. tests/model/test_llama_parity.py serves the bundled
SmolLM2 this way (its 538 MB of weights on 2 MB pages) and checks it against transformers."""

import sys
from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.worker.conftest import BUCKETS, NUM_PAGES, PAGE_SIZE, TINY
from worker_svc.engine import Engine
from worker_svc.huge_pages import PAGE, on_huge_pages
from worker_svc.models.llama import Llama

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="2 MB pages are asked for on Linux only")


def huge_kb(pointer: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds `pointer`."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= pointer < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {pointer:#x}")


def spans_of(array) -> int:
    """Bytes of the 2 MB-aligned span inside an array's buffer."""
    pointer = array.unsafe_buffer_pointer()
    return max(0, (pointer + array.nbytes) // PAGE * PAGE - -(-pointer // PAGE) * PAGE)


def granted_or_skip(pages) -> None:
    if pages.why:
        pytest.skip(f"this machine declines 2 MB pages: {pages.why}")


def test_a_large_buffer_goes_onto_2mb_pages_with_its_values_unchanged():
    values = np.random.default_rng(0).standard_normal(3 * PAGE // 4 + 1000).astype(np.float32)  # 6 MB and some
    big, small = jnp.asarray(values), jnp.arange(1000, dtype=jnp.float32)
    pages = on_huge_pages({"big": big, "small": small})
    assert pages.asked == spans_of(big) >= 2 * PAGE  # the small one is not asked about
    granted_or_skip(pages)
    assert pages.granted == pages.asked
    pointer = big.unsafe_buffer_pointer()
    assert huge_kb(-(-pointer // PAGE) * PAGE) >= 2048
    np.testing.assert_array_equal(np.asarray(big), values)
    assert float(small.sum()) == 999 * 1000 / 2
    assert on_huge_pages(big) == pages  # asked again: already there


def test_small_buffers_are_not_asked_about():
    pages = on_huge_pages([jnp.ones(PAGE // 4 - 1), jnp.ones((10, 10))])
    assert (pages.granted, pages.asked) == (0, 0)


def test_the_engine_asks_at_start_and_again_for_the_buffers_a_weight_update_brings():
    cfg = replace(TINY, vocab=16384, dim=64, heads=8, head_dim=8)  # a 4 MB table
    engine = Engine(Llama(cfg, rngs=nnx.Rngs(0)), BUCKETS, PAGE_SIZE, NUM_PAGES)
    table = engine.params["embed"]["table"][...]
    assert engine.weight_pages.asked == spans_of(table) >= PAGE
    granted_or_skip(engine.weight_pages)
    assert huge_kb(-(-table.unsafe_buffer_pointer() // PAGE) * PAGE) >= 2048

    engine.stage_dummy(seed=5)
    engine.commit_weights()
    new = engine.params["embed"]["table"][...]
    assert engine.weight_pages.asked == spans_of(new) and engine.weight_pages.granted == engine.weight_pages.asked
    assert huge_kb(-(-new.unsafe_buffer_pointer() // PAGE) * PAGE) >= 2048

    off = Engine(Llama(cfg, rngs=nnx.Rngs(0)), BUCKETS, PAGE_SIZE, NUM_PAGES, huge_pages=False)
    assert (off.weight_pages.granted, off.weight_pages.asked) == (0, 0)
