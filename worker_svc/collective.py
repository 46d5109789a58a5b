"""The worker's receiving rank of collective weight sync: a trainer's rank 0 broadcasts each bucket
of tensors in a torch.distributed group (SGLang's /init_weights_update_group protocol, xorl's
two-phase one, vLLM's weight transfer), and this worker, one rank of the group, receives them
straight into the buffers that control.py stages as any bucket of tensors (swap.py).

The only module of the services that imports torch (the optional extra `jaxstream[rl]`), imported
by control.py when a group is first joined: a stack that never joins one never loads torch.

1. Join: rendezvous at the trainer's master_address:master_port (its TCPStore), then a process
   group of `world_size` ranks, its keys under the prefix `group`, as SGLang's
   init_custom_process_group makes it (the trainers of SGLang, xorl, AReaL and SkyRL make theirs
   the same way): no default process group, so a worker may be in several groups. This worker is
   rank `rank_offset + replica`; the join returns once every rank has joined (TIMEOUT_S at most).
2. Receive: a buffer per tensor, or per packed buffer (protocol.Broadcast.packing), of the declared
   dtype and shape, on the CPU under gloo, on the worker's first GPU under NCCL; the broadcast from
   rank 0 fills it. Each is handed over without a copy: a CPU buffer as a numpy view of its memory
   (bfloat16 and float8 through an integer view and ml_dtypes), a packed one split into views; a
   GPU buffer as a JAX array by DLPack. The copies that remain are the staging's (swap.py): each
   tensor written into a host copy of its parameter (a row of a stacked one, in our layout), put on
   the devices with the parameter's sharding: moe=ep's expert shards take their rows there.
3. A staging that stops (an unknown name, a wrong shape) still receives the rest of its bucket, so
   the trainer's broadcast ends and it hears the refusal over HTTP. A transport error (the trainer
   died, a timeout) leaves the group unusable: it is destroyed and forgotten, and the error names
   the tensor; an init of the same name then starts afresh.
"""

from __future__ import annotations

import datetime
import inspect
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

from jaxstream import protocol
from worker_svc.control import no_group

log = logging.getLogger(__name__)

TIMEOUT_S = 600.0  # a join waiting for the other ranks; a receive waiting for the trainer's broadcast
PROBE_S = 10.0  # how long a join waits for the trainer's store to listen (it starts it as it asks, or before)
# torch dtypes numpy has no name for: viewed as the integer of their size, then as ml_dtypes' type
NUMPY_VIEWS = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16), torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
               torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2)}


class GroupBroken(ValueError):
    """The group's transport failed mid-receive (the group is then gone): a failure its message
    says all of, answered as a refusal is."""


class Group:
    """One joined group: its process group, this worker's rank in it, where its buffers live."""

    def __init__(self, name: str, pg: dist.ProcessGroup, rank: int, world_size: int, device: torch.device) -> None:
        self.name, self.pg, self.rank, self.world_size, self.device = name, pg, rank, world_size, device

    def tensors(self, b: protocol.Broadcast) -> Iterator[tuple[str, object]]:
        """(name, array) of each tensor of `b`, received as the caller asks for the next one."""
        for chunk in chunks(b):
            sizes = [protocol.WIRE_DTYPES[b.dtypes[i]] * _count(b.shapes[i]) for i in chunk]
            if b.packing == 0:
                buffer = torch.empty(b.shapes[chunk[0]], dtype=getattr(torch, b.dtypes[chunk[0]]), device=self.device)
            else:
                buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            self._receive(buffer, b.names[chunk[0]])
            if b.packing == 0:
                yield b.names[chunk[0]], handed(buffer)
                continue
            offset = 0
            for i, size in zip(chunk, sizes):
                yield b.names[i], unpacked(buffer[offset:offset + size], b.dtypes[i], b.shapes[i])
                offset += size

    def _receive(self, buffer: torch.Tensor, first: str) -> None:
        try:
            dist.broadcast(buffer, src=0, group=self.pg)
            if buffer.is_cuda:
                torch.cuda.current_stream(buffer.device).synchronize()  # the bytes are there before JAX reads them
        except RuntimeError as exc:  # gloo's and NCCL's errors: a peer gone, a timeout
            raise GroupBroken(f"receiving {first!r} in group {self.name!r} failed: {exc}") from None


class Groups:
    """The groups this worker is a rank of, by name."""

    def __init__(self, replica: int) -> None:
        self.replica = replica
        self.groups: dict[str, Group] = {}
        self.lock = threading.Lock()  # joins, leaves and receives run in threads of their own

    def join(self, msg: protocol.WeightGroup) -> str:
        """Join `msg.group` as rank rank_offset + replica; blocks until every rank has. A group of
        the same name is left first (a trainer that restarted makes its group again)."""
        if msg.group in self.groups:
            log.info("group %r joined again: leaving the old one first", msg.group)
            self.leave(msg.group)
        rank = msg.rank_offset + self.replica
        backend, device = backend_and_device(msg.backend)
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        listening(msg.master_address, msg.master_port)
        try:
            store, rank, world_size = next(rendezvous(f"tcp://{msg.master_address}:{msg.master_port}", rank, msg.world_size,
                                                      timeout=timeout))
            store.set_timeout(timeout)
            options = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters else "pg_options"
            pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(msg.group, store), group_name=msg.group,
                                              timeout=timeout, **{options: None})
        except (RuntimeError, ValueError) as exc:  # no trainer there, a rank missing past the timeout, a rank taken
            raise ValueError(f"joining group {msg.group!r} at {msg.master_address}:{msg.master_port} as rank {rank} of "
                             f"{msg.world_size} ({backend}) failed: {exc}") from None
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # its ranks are the global ones (no default group)
        with self.lock:
            self.groups[msg.group] = Group(msg.group, pg, rank, world_size, device)
        return f"joined group {msg.group!r} as rank {rank} of {world_size} ({backend}, receiving on {device})"

    def leave(self, name: str) -> str:
        with self.lock:
            group = self._group(name)
            del self.groups[name]
        try:
            dist.destroy_process_group(group.pg)
        except (RuntimeError, ValueError) as exc:  # a broken group: forgotten all the same
            log.warning("destroying group %r: %s", name, exc)
        return f"left group {name!r}"

    @contextmanager
    def receiving(self, b: protocol.Broadcast) -> Iterator[Iterator[tuple[str, object]]]:
        """The tensors of `b` as they arrive. Whatever the caller stops at, the rest of the bucket
        is received (and dropped) on leaving, so the trainer's broadcast ends; a transport error
        forgets the group (it cannot be used again) and is raised."""
        with self.lock:
            group = self._group(b.group)
        tensors = group.tensors(b)
        try:
            yield tensors
            for _ in tensors:  # a caller that took fewer than were sent
                pass
        except GroupBroken:
            self._forget(group)
            raise
        except BaseException:
            try:
                for _ in tensors:
                    pass
            except GroupBroken:
                self._forget(group)
            raise

    def _group(self, name: str) -> Group:
        if name not in self.groups:
            joined = f"; joined: {sorted(self.groups)}" if self.groups else ""
            raise ValueError(no_group(name) + joined)
        return self.groups[name]

    def _forget(self, group: Group) -> None:
        if self.groups.get(group.name) is group:
            self.leave(group.name)


def listening(address: str, port: int) -> None:
    """Return once something accepts connections at address:port (the trainer's store), within
    PROBE_S; else ValueError saying so, rather than a rendezvous that waits TIMEOUT_S for nobody."""
    deadline = time.monotonic() + PROBE_S
    while True:
        try:
            socket.create_connection((address, port), timeout=max(0.1, deadline - time.monotonic())).close()
            return
        except socket.gaierror as exc:
            raise ValueError(f"master_address {address!r} does not resolve: {exc.strerror}") from None
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ValueError(f"nothing accepts connections at {address}:{port} after {PROBE_S:.0f} s ({exc.strerror or exc}): "
                                 "the trainer's rank 0 listens there (its TCPStore) when it asks the server to join") from None
        time.sleep(0.2)


def backend_and_device(backend: str) -> tuple[str, torch.device]:
    """(the group's backend, where its buffers live): NCCL receives on the worker's first GPU (the
    one JAX counts first), gloo on the CPU; "" chooses by the worker's devices."""
    import jax

    first = jax.local_devices()[0]
    if first.platform == "gpu" and backend in ("", "nccl"):
        return "nccl", torch.device("cuda", first.local_hardware_id)
    if backend == "nccl":
        raise ValueError(f"backend 'nccl' needs GPUs; this worker's devices are {first.platform}: use backend 'gloo'")
    return "gloo", torch.device("cpu")


def chunks(b: protocol.Broadcast) -> list[list[int]]:
    """The tensors of each broadcast, by index: one each; all in one (PACKED_WHOLE); or vLLM's
    packed buffers, each closed by the tensor whose bytes pass `packing` (its consumer's rule)."""
    n = len(b.names)
    if b.packing == 0:
        return [[i] for i in range(n)]
    if b.packing == protocol.PACKED_WHOLE:
        return [list(range(n))] if n else []
    out: list[list[int]] = [[]]
    size = 0
    for i in range(n):
        out[-1].append(i)
        size += protocol.WIRE_DTYPES[b.dtypes[i]] * _count(b.shapes[i])
        if size > b.packing and i < n - 1:
            out.append([])
            size = 0
    return out if out[0] else []


def handed(buffer: torch.Tensor) -> object:
    """The received buffer as an array the staging reads, sharing its memory."""
    if buffer.is_cuda:
        import jax.dlpack

        return jax.dlpack.from_dlpack(buffer)
    if buffer.dtype in NUMPY_VIEWS:
        integer, numpy_type = NUMPY_VIEWS[buffer.dtype]
        return buffer.view(integer).numpy().view(numpy_type)
    return buffer.numpy()


def unpacked(piece: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> object:
    """One tensor of a packed buffer (its bytes, uint8), as `handed` gives it. On the CPU a numpy
    view, aligned or not; on a GPU a torch view where the offset is aligned, else a copy."""
    if not piece.is_cuda:
        numpy_type = NUMPY_VIEWS.get(getattr(torch, dtype), (None, np.dtype(dtype)))[1]
        return piece.numpy().view(numpy_type).reshape(shape)
    typed = getattr(torch, dtype)
    try:
        view = piece.view(typed)
    except RuntimeError:  # an offset not a multiple of the element size
        view = piece.clone().view(typed)
    return handed(view.reshape(shape))


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
