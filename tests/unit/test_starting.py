"""Start-up honesty without Redis: the gateway's 503 tells a starting role from a missing one, and a
worker's start-up progress reaches its phase."""

from gateway.watchdog import starting_labels, unavailable_message
from worker_svc.start import no_libtpu


def test_a_missing_worker_that_is_starting_says_how_far_it_got():
    starting = starting_labels({"worker.0.ab12cd34": "compiling step shapes 40/66"}, 1)
    assert unavailable_message(["worker"], starting) == "the worker is starting: compiling step shapes 40/66"


def test_a_role_starting_without_a_phase_yet_says_just_that():
    assert unavailable_message(["scheduler", "worker"], {"scheduler": "", "worker": "starting JAX"}) == \
        "the scheduler is starting; the worker is starting: starting JAX"


def test_a_worker_missing_altogether_keeps_the_old_message():
    assert unavailable_message(["worker"], {}) == "service unavailable: no worker running"
    # one really missing role outweighs one that is starting
    assert unavailable_message(["tokenizer", "worker"], {"worker": "loading weights"}) == \
        "service unavailable: no tokenizer running"


def test_replicas_are_named_as_health_names_them():
    assert starting_labels({"worker.1.ab12cd34": "loading weights 3/30", "tokenizer.ffff0000": "starting"}, 2) == \
        {"worker.1": "loading weights 3/30", "tokenizer": "starting"}


def test_only_the_absent_libtpu_probe_is_silenced():
    import logging

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("jax._src.xla_bridge", logging.INFO, "", 0, message, None, None)

    assert not no_libtpu(record("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: "
                                "libtpu.so: cannot open shared object file: No such file or directory"))
    assert no_libtpu(record("Unable to initialize backend 'tpu': TPU initialization failed: chip busy"))
    assert no_libtpu(record("Unable to initialize backend 'cuda': no CUDA devices"))
