"""jaxstream/preflight.py refuses a model x parallelism composition before anything starts exactly when
the worker would refuse it at start-up (tests/worker/test_compositions.py lays each out as the worker
does), with the same message: so `jaxstream up` never starts a stack whose worker must fail."""

import pytest

from jaxstream.config import ConfigError, load_config
from jaxstream.preflight import check_layout, model_numbers
from tests.worker.test_compositions import LAYOUTS, MODELS, expected_failure, overrides


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_preflight_refuses_a_layout_exactly_when_the_worker_does(model, layout):
    # Dummy weights: the released models' numbers from their hf_config (their path is a stand-in), as
    # test_compositions builds them; SmolLM2's from its GGUF's header.
    cfg = load_config([*overrides(model, layout, "fused"), "worker.weights=dummy"])
    failure = expected_failure(model, layout)
    if failure is None:
        check_layout(cfg.parallelism, lambda: model_numbers(cfg))
    else:
        with pytest.raises(ConfigError, match=failure):
            check_layout(cfg.parallelism, lambda: model_numbers(cfg))
