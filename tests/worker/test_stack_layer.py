"""layers/stack_layer.py: in a step of few rows with the product kernel, the layer scan hands each
stacked matmul weight whole with its layer row, and no compiled step writes a layer weight out
(counted in the HLO); without the kernel the scan slices each weight out (the detector sees it),
but never transposes one (o's weight, its two contracted axes merged into one by Numerics)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.worker.conftest import BUCKETS, NUM_PAGES, PAGE_SIZE, TINY
from tests.worker.hlo_check import weight_writes
from tests.worker.int8_check import built
from worker_svc.cpu_kernels import product_kernel
from worker_svc.cpu_kernels.kernels import CpuKernels
from worker_svc.engine import Engine
from worker_svc.layers.numerics import Numerics
from worker_svc.models.llama import Llama

# Layer weights of shapes no activation of a BUCKETS step has: dims 3, 40, 96, 112 (the cache is [L, P, 4, 1, 40]).
ODD = dataclasses.replace(TINY, dim=96, heads=3, kv_heads=1, head_dim=40, mlp_dim=112, layers=3)
ODD_WEIGHTS = ((96, 3, 40), (96, 1, 40), (3, 40, 96), (96, 112), (112, 96))  # q, k and v, o, gate and up, down
SHAPES = [(1, 0, BUCKETS.max_pages), (2, 0, BUCKETS.max_pages), (16, 64, 0)]  # page-list decode steps and a pairs prefill step


def weight_copies(hlo: str) -> list[str]:
    return weight_writes(hlo, ODD_WEIGHTS)


def test_the_stacked_scan_writes_out_each_layer_weight_but_transposes_none():
    stacked = Engine(built(Llama, ODD), BUCKETS, PAGE_SIZE, NUM_PAGES)
    for shape in SHAPES:
        # The detector sees copies: the scan's slice of each weight at least, but no transpose of one
        # (o's weight, its two contracted axes merged into one by Numerics, is read in its own order).
        copies = weight_copies(stacked.executables.lower_forward(shape).compile().as_text())
        assert len(copies) >= len(ODD_WEIGHTS), shape
        assert [line for line in copies if " transpose(" in line] == [], shape


@pytest.mark.skipif(bool(product_kernel.load()), reason="the product kernel cannot be built here")
def test_with_the_product_kernel_a_step_of_up_to_32_rows_reads_the_stacked_weights_in_place():
    """The layer scan hands the kernel each stacked weight whole with its layer row (decoder.py), so
    decode steps and a 16-token prefill write no layer weight out (float32: up to 32 rows; the test
    above has the detector see the stacked scan's slices)."""
    numerics = Numerics(kernels=CpuKernels(products=True))
    engine = Engine(built(Llama, dataclasses.replace(ODD, numerics=numerics)), BUCKETS, PAGE_SIZE, NUM_PAGES)
    for shape in SHAPES:
        assert weight_copies(engine.executables.lower_forward(shape).compile().as_text()) == [], shape
