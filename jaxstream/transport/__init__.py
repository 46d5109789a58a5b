"""The Redis Streams transport: a service's `Bus` (publishing, heartbeat and stats, liveness,
shared state: bus.py), its `Consumer`s (group reads, acks, reclaim, trimming: consumer.py), and
whether a live instance does the work it holds (liveness.py).

Only client.py imports `redis`. What needs no Redis lives beside this package: key and instance
names (jaxstream.names), what the liveness keys hold (jaxstream.heartbeat), the outage reporter
(jaxstream.outage), the stats' types (jaxstream.protocol.stats).
"""

from __future__ import annotations

from jaxstream.transport.bus import Bus, StreamMissing, forget_processes
from jaxstream.transport.client import TRANSIENT
from jaxstream.transport.consumer import FIELD, Consumer
from jaxstream.transport.liveness import stalled_processes, stalls
