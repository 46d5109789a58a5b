"""The registry: a checkpoint config's architecture name -> (model class, its config class, its
checkpoint mapping); and every mapping transform's inverse (our layout -> Hugging Face's)."""

from __future__ import annotations

from worker_svc.models.llama import CHECKPOINT as LLAMA_CHECKPOINT
from worker_svc.models.llama import TO_HF as LLAMA_TO_HF
from worker_svc.models.llama import Llama, LlamaConfig
from worker_svc.models.qwen3 import CHECKPOINT as QWEN3_CHECKPOINT
from worker_svc.models.qwen3 import TO_HF as QWEN3_TO_HF
from worker_svc.models.qwen3 import Qwen3, Qwen3Config
from worker_svc.models.qwen3_moe import CHECKPOINT as QWEN3_MOE_CHECKPOINT
from worker_svc.models.qwen3_moe import TO_HF as QWEN3_MOE_TO_HF
from worker_svc.models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig

ARCHITECTURES = {
    "LlamaForCausalLM": (Llama, LlamaConfig, LLAMA_CHECKPOINT),
    "Qwen3ForCausalLM": (Qwen3, Qwen3Config, QWEN3_CHECKPOINT),
    "Qwen3MoeForCausalLM": (Qwen3Moe, Qwen3MoeConfig, QWEN3_MOE_CHECKPOINT),
}
TO_HF = LLAMA_TO_HF | QWEN3_TO_HF | QWEN3_MOE_TO_HF
