"""engine_api.StepEngine, what the worker service and the in-process driver call on an engine: the
JAX engine and the fake one each have every one of its methods, with its parameters (names, kinds,
defaults, annotations, in order; more of their own only with defaults) and its return annotation."""

import inspect

import pytest

from jaxstream.protocol import Step, StepResult
from worker_svc.engine import Engine
from worker_svc.engine_api import StepEngine
from worker_svc.fake import FakeEngine


def methods(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")]


def mismatches(cls: type, protocol: type) -> list[str]:
    """Where `cls` does not offer a method of `protocol` as the protocol declares it."""
    found = []
    for name in methods(protocol):
        if not inspect.isfunction(getattr(cls, name, None)):
            found.append(f"{cls.__name__} has no method {name}")
            continue
        want = inspect.signature(getattr(protocol, name), eval_str=True)
        got = inspect.signature(getattr(cls, name), eval_str=True)
        wanted, given = list(want.parameters.values()), list(got.parameters.values())
        if given[:len(wanted)] != wanted:
            found.append(f"{cls.__name__}.{name}{got}: the protocol's parameters are {want}")
        required = [p.name for p in given[len(wanted):] if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if required:
            found.append(f"{cls.__name__}.{name} requires {required}, which the protocol's callers never pass")
        if got.return_annotation != want.return_annotation:
            found.append(f"{cls.__name__}.{name} returns {got.return_annotation}, the protocol {want.return_annotation}")
    return found


@pytest.mark.parametrize("cls", [Engine, FakeEngine])
def test_the_jax_engine_and_the_fake_offer_every_method_of_step_engine_as_declared(cls):
    assert len(methods(StepEngine)) == 12
    assert mismatches(cls, StepEngine) == []


def test_a_method_missing_renamed_retyped_or_asking_more_is_named():
    class Wrong:
        def step(self, message: Step) -> StepResult: ...  # renamed parameter

        def stats(self) -> dict[str, int]: ...  # another return type

        def stage_disk(self, path: str, load_format: str | None = None, strict: bool = False) -> int: ...  # more, with a default: fine

        def stage_dummy(self, seed: int, device: str) -> int: ...  # more, required

        def commit_weights(self) -> int: ...

    found = "\n".join(mismatches(Wrong, StepEngine))
    assert "Wrong.step(self, message: " in found
    assert "Wrong.stats returns dict[str, int]" in found
    assert "Wrong.stage_disk" not in found and "Wrong.commit_weights" not in found
    assert "Wrong.stage_dummy requires ['device']" in found
    for absent in ("weight_names", "stage_tensors", "discard_weights", "release", "resume_kv_cache"):
        assert f"Wrong has no method {absent}" in found
