"""MXFP4 tensors of a Hugging Face checkpoint, dequantized as they are read.

The released GPT-OSS checkpoints (config `quantization_config.quant_method: mxfp4`) hold each MoE
layer's expert matrices in the OCP Microscaling format: a tensor `X` is stored as `X_blocks` (uint8
[E, R, G, 16]: each row's values in G blocks of 32 FP4 E2M1 numbers, two to a byte, the low nibble
first) and `X_scales` (uint8 [E, R, G]: each block's E8M0 scale, the power of two 2^(s - 127)). A
row of X's [E, R, C] (C = 32 G) is its transpose [E, C, R], as transformers'
`convert_moe_packed_tensors` gives it: `gate_up_proj` [E, D, 2F] and `down_proj` [E, F, D], the
layouts of the float tensors transformers itself saves. `mxfp4_read` makes each such pair one tensor
`X` of that layout, in float32: every value is exact there (a 2-bit mantissa times a power of two),
and so in the model dtype the loader casts it to (bfloat16 included); worker.quantization=int8 then
requantizes it per output channel, as any float weight.
"""

from __future__ import annotations

import numpy as np

from worker_svc.weights import Checkpoint, CheckpointError

# FP4 E2M1 by its 4-bit code: sign, 2 exponent bits, 1 mantissa bit (OCP MX v1.0, table 5).
FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
E8M0_BIAS = 127
BLOCKS, SCALES = "_blocks", "_scales"


def is_mxfp4(config: dict) -> bool:
    """Whether a config.json says its checkpoint holds MXFP4 tensors."""
    return (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def mxfp4_read(checkpoint: Checkpoint) -> Checkpoint:
    """The checkpoint with each `X_blocks` and `X_scales` pair read as one float32 tensor `X`, and every
    other tensor as before."""
    names = set(checkpoint.names)
    packed = {name.removesuffix(BLOCKS) for name in names if name.endswith(BLOCKS) and name.removesuffix(BLOCKS) + SCALES in names}
    kept = tuple(name for name in checkpoint.names if name.removesuffix(BLOCKS).removesuffix(SCALES) not in packed)

    def read(name: str) -> np.ndarray:
        if name not in packed:
            return checkpoint.read(name)
        try:
            return dequantize(checkpoint.read(name + BLOCKS), checkpoint.read(name + SCALES))
        except ValueError as e:
            raise CheckpointError(f"{checkpoint.path}: {name}{BLOCKS} and {name}{SCALES}: {e}") from None

    return Checkpoint(checkpoint.path, checkpoint.config, kept + tuple(sorted(packed)), read)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [E, R, G, 16] and scales uint8 [E, R, G] -> float32 [E, 32 G, R]."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, these are {blocks.dtype} and {scales.dtype}")
    if blocks.ndim != 4 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [E, R, G, 16] and scales [E, R, G] expected, got {list(blocks.shape)} and {list(scales.shape)}")
    values = np.empty((*blocks.shape[:-1], 32), np.float32)  # [E, R, G, 32]
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    exponents = scales.astype(np.int32)[..., None] - E8M0_BIAS  # [E, R, G, 1]
    rows = np.ldexp(values, exponents).reshape(*blocks.shape[:2], -1)  # [E, R, 32 G]
    return np.ascontiguousarray(rows.transpose(0, 2, 1))
