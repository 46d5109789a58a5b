"""Every Redis key's name, and what a service instance's name says (its role, its replica).

An instance is named `<role>.<random>`, or `<role>.<replica>.<random>` for a scheduler or worker:
each data-parallel replica (a scheduler+worker pair) has streams of its own.
"""

from __future__ import annotations

# Roles with one instance group per data-parallel replica; their instance names carry the replica.
REPLICATED = ("scheduler", "worker")


def role_of(name: str) -> str:
    return name.split(".", 1)[0]


def replica_of(name: str) -> int | None:
    """The replica of a scheduler or worker instance (`worker.1.ab12cd34` -> 1); None for other roles."""
    parts = name.split(".")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


class Keys:
    """Every key name, derived from the namespace so two stacks can share one Redis. A data-parallel
    replica has streams of its own: `scheduler(r)`, `worker(r)`, `results(r)`."""

    def __init__(self, namespace: str) -> None:
        ns = namespace
        self.tokenizer = f"{ns}:stream:tokenizer"
        # A tokenizer hands a large prompt over to this stream of its own (tokenizer_svc/lanes.py)
        self.tokenizer_large = f"{ns}:stream:tokenizer:large"
        self.dead = f"{ns}:stream:dead"
        self.epoch = f"{ns}:epoch"
        self._ns = ns

    def scheduler(self, replica: int) -> str:
        return f"{self._ns}:stream:scheduler:{replica}"

    def worker(self, replica: int) -> str:
        return f"{self._ns}:stream:worker:{replica}"

    def results(self, replica: int) -> str:
        return f"{self._ns}:stream:results:{replica}"

    def gateway(self, gateway_name: str) -> str:
        return f"{self._ns}:stream:gateway:{gateway_name}"

    def detokenizer(self, detokenizer_name: str) -> str:
        return f"{self._ns}:stream:detokenizer:{detokenizer_name}"

    def heartbeat(self, name: str) -> str:
        """While the instance is ready, with a TTL: jaxstream.heartbeat says what it holds."""
        return f"{self._ns}:hb:{name}"

    def stats(self, name: str) -> str:
        """The instance's protocol.Stats, expiring with its heartbeat."""
        return f"{self._ns}:stats:{name}"

    def starting(self, name: str) -> str:
        """Until the instance is ready: its start-up phase (jaxstream.heartbeat)."""
        return f"{self._ns}:starting:{name}"

    def blob(self, name: str) -> str:
        """Bytes too big for a message (a weight update's tensors), in parts, with a TTL."""
        return f"{self._ns}:blob:{name}"

    @property
    def hold(self) -> str:
        """A hash: why new requests wait at every gateway (reason -> deadline, 0 for none)."""
        return f"{self._ns}:hold"

    @property
    def adapters(self) -> str:
        """A hash: the LoRA adapters loaded (name -> the path it came from, "" for pushed tensors), which
        every gateway reads for /v1/models and to check a request's adapter."""
        return f"{self._ns}:adapters"

    @property
    def weight_names(self) -> str:
        """The model's checkpoint tensors (JSON), as the worker reads them: /list_weights."""
        return f"{self._ns}:weight_names"
