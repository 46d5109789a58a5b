"""Which LoRA adapter is in which of the worker's device slots (worker.lora.max_adapters), per replica.

Pure, like the core: names and slot numbers in, slot numbers out. The rules:

1. A name maps to one live slot under a generation, a number this registry never gives twice (0 is
   the base model's). The generation is the prefix cache's key beside the tokens (radix.py's
   `namespace`): a prefix cached under one adapter, or under an earlier load of the same name, is
   never reused under another.
2. A load (`reserve`) takes a free slot, never one a running or waiting request reads: the worker
   writes it between steps while the live slot keeps serving, so no request sees half an adapter.
   When none is free, a reload of a name that no request reads takes the name's own slot; else
   the load is refused (too many adapters). Until the worker answers, the slot is reserved;
   `loaded` then maps the name to it (its earlier slot drains), `failed` frees it.
3. An unload removes the name at once (new requests naming it are refused); its slot, like the
   slot a reload left, drains: it is freed once no request holds it (`sweep`, given the slots
   requests hold). So a request keeps its adapter to its end (the issue's choice, documented in
   docs/api.md: unload is never refused for requests running).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxstream.english import counted

BASE = -1  # the slot of a request without adapter


class UnknownAdapter(ValueError):
    """No adapter of that name is loaded (vLLM's 404: an adapter is a model)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{name}` does not exist.")


@dataclass(frozen=True)
class Placed:
    slot: int
    generation: int  # the prefix cache's key for this load
    path: str  # where it came from ("" for pushed tensors)


class AdapterRegistry:
    def __init__(self, slots: int, start: dict[str, tuple[int, str]] | None = None) -> None:
        """`start`: the adapters the worker loads at start, name -> (slot, path) (worker.lora.adapters,
        in LoraConfig.start_slots)."""
        self.slots = slots
        self.start = dict(start or {})
        self._generation = 0
        self.reset()

    def reset(self) -> None:
        """As at start: the worker (a new one, after a stop) holds the start adapters alone."""
        self.reserved: dict[int, str] = {}  # slot -> the name being loaded into it
        self.draining: set[int] = set()  # slots no name maps to, still read by some request
        self.live: dict[str, Placed] = {}
        for name, (slot, path) in self.start.items():
            self._generation += 1
            self.live[name] = Placed(slot, self._generation, path)

    def resolve(self, name: str) -> tuple[int, int]:
        """(slot, generation) of the adapter `name`; "" is the base model (BASE, 0)."""
        if not name:
            return BASE, 0
        placed = self.live.get(name)
        if placed is None:
            raise UnknownAdapter(name)
        return placed.slot, placed.generation

    def reserve(self, name: str, in_use: set[int]) -> int:
        """A slot to load `name` into (rule 2); ValueError naming why there is none."""
        if self.slots == 0:
            raise ValueError("this server has no adapter slots: set worker.lora.max_adapters above 0")
        if name in self.reserved.values():
            raise ValueError(f"adapter {name!r} is being loaded already")
        taken = {p.slot for p in self.live.values()} | set(self.reserved) | self.draining | in_use
        free = [s for s in range(self.slots) if s not in taken]
        if free:
            slot = free[0]
        elif name in self.live and self.live[name].slot not in in_use:
            slot = self.live[name].slot  # no request reads it: rewritten in place
        else:
            names = sorted(self.live)
            raise ValueError(f"too many adapters: worker.lora.max_adapters is {self.slots} and every slot is taken "
                             f"(loaded: {', '.join(names) or 'none'}; {counted(len(self.draining), 'slot')} draining): "
                             "unload one first")
        self.reserved[slot] = name
        return slot

    def loaded(self, slot: int, path: str) -> Placed:
        """The worker wrote `slot`: its name maps to it under a new generation."""
        name = self.reserved.pop(slot)
        old = self.live.get(name)
        if old is not None and old.slot != slot:
            self.draining.add(old.slot)
        self._generation += 1
        self.live[name] = Placed(slot, self._generation, path)
        return self.live[name]

    def failed(self, slot: int) -> None:
        """The worker refused the load: the slot is free again (the worker wrote nothing of it)."""
        self.reserved.pop(slot, None)

    def unload(self, name: str) -> Placed:
        placed = self.live.pop(name, None)
        if placed is None:
            raise UnknownAdapter(name)
        self.draining.add(placed.slot)
        return placed

    def sweep(self, in_use: set[int]) -> None:
        """Free the draining slots no request holds any more."""
        self.draining &= in_use
