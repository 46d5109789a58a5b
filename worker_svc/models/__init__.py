"""The registry: a checkpoint config's architecture name -> (model class, its config class, its
checkpoint mapping); and every mapping transform's inverse (our layout -> Hugging Face's). Its names
are jaxstream.architectures.SERVED, which preflight reads without importing the worker."""

from __future__ import annotations

from worker_svc.models.deepseek import CHECKPOINT as DEEPSEEK_CHECKPOINT
from worker_svc.models.deepseek import TO_HF as DEEPSEEK_TO_HF
from worker_svc.models.deepseek import DeepseekV2, DeepseekV2Config, DeepseekV3, DeepseekV3Config
from worker_svc.models.gemma2 import CHECKPOINT as GEMMA2_CHECKPOINT
from worker_svc.models.gemma2 import TO_HF as GEMMA2_TO_HF
from worker_svc.models.gemma2 import Gemma2, Gemma2Config
from worker_svc.models.gemma3 import CHECKPOINT as GEMMA3_CHECKPOINT
from worker_svc.models.gemma3 import TO_HF as GEMMA3_TO_HF
from worker_svc.models.gemma3 import Gemma3, Gemma3Config
from worker_svc.models.gpt_oss import CHECKPOINT as GPT_OSS_CHECKPOINT
from worker_svc.models.gpt_oss import TO_HF as GPT_OSS_TO_HF
from worker_svc.models.gpt_oss import GptOss, GptOssConfig
from worker_svc.models.llama import CHECKPOINT as LLAMA_CHECKPOINT
from worker_svc.models.llama import TO_HF as LLAMA_TO_HF
from worker_svc.models.llama import Llama, LlamaConfig
from worker_svc.models.mistral import CHECKPOINT as MISTRAL_CHECKPOINT
from worker_svc.models.mistral import TO_HF as MISTRAL_TO_HF
from worker_svc.models.mistral import Mistral, MistralConfig
from worker_svc.models.mixtral import CHECKPOINT as MIXTRAL_CHECKPOINT
from worker_svc.models.mixtral import TO_HF as MIXTRAL_TO_HF
from worker_svc.models.mixtral import Mixtral, MixtralConfig
from worker_svc.models.qwen2 import CHECKPOINT as QWEN2_CHECKPOINT
from worker_svc.models.qwen2 import TO_HF as QWEN2_TO_HF
from worker_svc.models.qwen2 import Qwen2, Qwen2Config
from worker_svc.models.qwen3_5 import CHECKPOINT as QWEN3_5_CHECKPOINT
from worker_svc.models.qwen3_5 import TO_HF as QWEN3_5_TO_HF
from worker_svc.models.qwen3_5 import Qwen3_5, Qwen3_5Config
from worker_svc.models.qwen3_5_moe import CHECKPOINT as QWEN3_5_MOE_CHECKPOINT
from worker_svc.models.qwen3_5_moe import NEXT_CHECKPOINT as QWEN3_NEXT_CHECKPOINT
from worker_svc.models.qwen3_5_moe import TO_HF as QWEN3_5_MOE_TO_HF
from worker_svc.models.qwen3_5_moe import Qwen3_5Moe, Qwen3_5MoeConfig, Qwen3Next, Qwen3NextConfig
from worker_svc.models.qwen3 import CHECKPOINT as QWEN3_CHECKPOINT
from worker_svc.models.qwen3 import TO_HF as QWEN3_TO_HF
from worker_svc.models.qwen3 import Qwen3, Qwen3Config
from worker_svc.models.qwen3_moe import CHECKPOINT as QWEN3_MOE_CHECKPOINT
from worker_svc.models.qwen3_moe import TO_HF as QWEN3_MOE_TO_HF
from worker_svc.models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig

ARCHITECTURES = {
    "DeepseekV2ForCausalLM": (DeepseekV2, DeepseekV2Config, DEEPSEEK_CHECKPOINT),
    "DeepseekV3ForCausalLM": (DeepseekV3, DeepseekV3Config, DEEPSEEK_CHECKPOINT),
    "Gemma2ForCausalLM": (Gemma2, Gemma2Config, GEMMA2_CHECKPOINT),
    "Gemma3ForCausalLM": (Gemma3, Gemma3Config, GEMMA3_CHECKPOINT),
    "GptOssForCausalLM": (GptOss, GptOssConfig, GPT_OSS_CHECKPOINT),
    "LlamaForCausalLM": (Llama, LlamaConfig, LLAMA_CHECKPOINT),
    "MistralForCausalLM": (Mistral, MistralConfig, MISTRAL_CHECKPOINT),
    "MixtralForCausalLM": (Mixtral, MixtralConfig, MIXTRAL_CHECKPOINT),
    "Qwen2ForCausalLM": (Qwen2, Qwen2Config, QWEN2_CHECKPOINT),
    "Qwen3ForCausalLM": (Qwen3, Qwen3Config, QWEN3_CHECKPOINT),
    "Qwen3_5ForCausalLM": (Qwen3_5, Qwen3_5Config, QWEN3_5_CHECKPOINT),
    "Qwen3_5MoeForCausalLM": (Qwen3_5Moe, Qwen3_5MoeConfig, QWEN3_5_MOE_CHECKPOINT),
    "Qwen3NextForCausalLM": (Qwen3Next, Qwen3NextConfig, QWEN3_NEXT_CHECKPOINT),
    "Qwen3MoeForCausalLM": (Qwen3Moe, Qwen3MoeConfig, QWEN3_MOE_CHECKPOINT),
}
TO_HF = (DEEPSEEK_TO_HF | GEMMA2_TO_HF | GEMMA3_TO_HF | GPT_OSS_TO_HF | LLAMA_TO_HF | MISTRAL_TO_HF | MIXTRAL_TO_HF | QWEN2_TO_HF | QWEN3_TO_HF
         | QWEN3_MOE_TO_HF | QWEN3_5_TO_HF | QWEN3_5_MOE_TO_HF)
