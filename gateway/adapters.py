"""Which LoRA adapters a request may name, and which one it names.

Every gateway reads the adapters loaded from one Redis hash (Bus.adapters: name -> the path it came
from), which the workers write for those they load at start (worker.lora.adapters) and the gateway
that loads or unloads one writes once every replica answered: so a gateway sees another's load as
soon as it is done, with one Redis read, and only for a request that names a model other than the
served one. The scheduler resolves the name again at admission (scheduler_svc/adapters.py): an
unload between the two ends the request with the same 404.

A request names its adapter as vLLM's do, by OpenAI's `model` (an adapter is a model; the served
name and "default" are the base model), or as SGLang's, by `lora_path` (a loaded adapter's name, on
/generate a list of them, one per prompt; null: the base model). An unknown model is vLLM's 404
"The model `x` does not exist."; an unknown `lora_path` SGLang's 400.
"""

from __future__ import annotations

from gateway.errors import ApiError, invalid
from gateway.params import check
from jaxstream.english import counted
from jaxstream.transport import Bus


def model_not_found(model: str) -> ApiError:
    """vLLM's words (entrypoints/openai/engine/serving.py, OpenAIServing._check_model), which its clients match."""
    return ApiError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


class Adapters:
    def __init__(self, bus: Bus, model_name: str) -> None:
        self.bus = bus
        self.model_name = model_name  # the base model's served name

    async def loaded(self) -> dict[str, str]:
        """The adapters loaded on the replicas, name -> the path it came from ("" for pushed tensors)."""
        return await self.bus.adapters()

    async def of_model(self, model: str | None) -> str:
        """The adapter OpenAI's `model` names: "" for the base model (none given, the served name, "default")."""
        if model is None or model in (self.model_name, "default"):
            return ""
        if model in await self.loaded():
            return model
        raise model_not_found(model)

    async def request_adapter(self, body: dict, model: str | None = None) -> str:
        """The one adapter of an OpenAI route's request: its `lora_path` (or `lora_name`), else its model's."""
        lora = await self.lora_paths(body, 1)
        return lora[0] if lora[0] is not None else await self.of_model(model)

    async def lora_paths(self, body: dict, prompts: int) -> list[str | None]:
        """SGLang's `lora_path` (or vLLM-style `lora_name`) for each of `prompts` prompts: None where
        none is named, else a loaded adapter's name ("" where it names the base model by its served name)."""
        name = next((n for n in ("lora_path", "lora_name") if body.get(n) is not None), None)
        if name is None:
            return [None] * prompts
        value = body[name]
        if isinstance(value, list):
            check(len(value) == prompts, name, f"gives {counted(len(value), 'adapter')} for {counted(prompts, 'prompt')}: one per prompt (null: none)")
        else:
            value = [value] * prompts
        check(all(v is None or isinstance(v, str) for v in value), name, "must be a loaded LoRA adapter's name, or a list of them")
        loaded = await self.loaded() if any(v not in (None, self.model_name) for v in value) else {}
        for v in value:
            if v is not None and v != self.model_name and v not in loaded:
                raise invalid(f"'{name}' names no loaded LoRA adapter: {v!r} (loaded: {', '.join(sorted(loaded)) or 'none'})", name)
        return [None if v is None else "" if v == self.model_name else v for v in value]

    async def cards(self) -> list[dict]:
        """vLLM's model cards of the adapters: `root` the path, `parent` the base model."""
        return [{"id": name, "object": "model", "created": 0, "owned_by": "jaxstream", "root": path, "parent": self.model_name}
                for name, path in sorted((await self.loaded()).items())]
