"""The registry: a checkpoint config's architecture name -> (model class, its config class)."""

from __future__ import annotations

from worker_svc.models.llama import CHECKPOINT as LLAMA_CHECKPOINT
from worker_svc.models.llama import Llama, LlamaConfig

ARCHITECTURES = {
    "LlamaForCausalLM": (Llama, LlamaConfig, LLAMA_CHECKPOINT),
}
