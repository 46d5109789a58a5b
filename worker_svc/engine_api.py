"""What the worker service asks of an engine (`StepEngine`): run a Step, report its stats, and the
weight and memory operations of the RL control surface (control.py). The JAX engine (engine.py)
and the fake one (fake.py) both offer it; the service (__main__.py, control.py) and the stack's
in-process driver (stack/driver.py, stack/bench/inprocess.py) type against it, so either serves.
tests/worker/test_engine_api.py checks both classes' methods against it, signatures included.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np

from jaxstream.protocol import ModelFacts, Step, StepResult


class StepEngine(Protocol):
    def step(self, step: Step) -> StepResult:
        """Run a Step on the device (or the fake's arithmetic): one StepResult, a row per sampled token.
        RuntimeError while memory is released."""

    facts: ModelFacts  # what the model is, as the heartbeat tells the gateway (protocol.WorkerStats.facts)

    def stats(self) -> dict[str, int | float]:
        """The fields of protocol.WorkerStats the engine knows, but its facts: the step counters."""

    def weight_names(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(Hugging Face name, shape in HF layout, serving dtype) of every tensor the model reads."""

    def stage_disk(self, path: str, load_format: str | None = None) -> int:
        """Stage every parameter from a checkpoint beside the live ones; how many. CheckpointError
        (and nothing staged) when it cannot."""

    def stage_tensors(self, tensors: Iterable[tuple[str, np.ndarray]]) -> int:
        """Stage tensors by Hugging Face name, one bucket of an update; how many. CheckpointError
        naming the tensor (and nothing staged) when one is unknown or misshapen."""

    def stage_dummy(self, seed: int) -> int:
        """Stage the random weights worker.weights=dummy starts with; how many."""

    def commit_weights(self) -> int:
        """Swap every staged parameter in, between steps; how many."""

    def discard_weights(self) -> None:
        """Drop whatever is staged; the live weights serve on."""

    def release(self, tags: set[str]) -> None:
        """Free the device memory of "weights" and/or "kv_cache"; no step runs until resumed."""

    def resume_kv_cache(self) -> None:
        """An empty KV cache again, after its release."""

    def load_adapter(self, slot: int, path: str) -> int:
        """Write the LoRA adapter of the PEFT directory `path` into adapter slot `slot`, between steps;
        its rank. ValueError naming what does not fit (nothing written)."""

    def load_adapter_tensors(self, slot: int, config: dict, tensors: list[tuple[str, np.ndarray]]) -> int:
        """The same from PEFT's LoRA config fields and the adapter's tensors by PEFT's names (a push)."""
