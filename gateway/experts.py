"""Routed experts export (SGLang's "R3"): who may ask, and how the answer is shown.

A request asks with `return_routed_experts` (and `routed_experts_start_len`, the first position,
within [0, prompt tokens]: the tokenizer checks the upper bound) at the top level of /generate,
/v1/completions and /v1/chat/completions, SGLang's names. The gateway refuses it (400) unless the
workers report the switch on (worker.enable_return_routed_experts) and a model with MoE layers,
from their heartbeat facts (Pipeline.model_facts).

The answer, once the request ended (SGLang's base64 form, with its shape and dtype beside it):

  routed_experts            base64 of little-endian int32, C order
  routed_experts_shape      [prompt + completion tokens - 1 - start_len, num_hidden_layers, k]
                            (fewer rows for a request aborted before they ran); the last sampled
                            token never ran through the model: no row
  routed_experts_dtype      "int32"
  routed_experts_start_len  the first position's

Row p, layer l: the k experts layer l's router chose for the token at position start_len + p, best
first; a dense layer's are 0 (SGLang's rule). /generate puts them in `meta_info`; the OpenAI routes
in `sglext` (SGLang's extension object): the response's for one choice, each choice's own for several.
"""

from __future__ import annotations

import base64

from gateway.errors import ApiError, invalid
from jaxstream import protocol

SWITCH = "worker.enable_return_routed_experts"


def routed_layout(facts: protocol.ModelFacts | None) -> tuple[int, int]:
    """(num_hidden_layers, experts per token) of the served model, or a 400 saying why it cannot
    return routed experts: the switch is off (or no worker has said it is on), or the model has no
    MoE layer."""
    if facts is None or not facts.enable_return_routed_experts:
        raise invalid(f"returning routed experts ('return_routed_experts') needs the server started with {SWITCH}=true",
                      "return_routed_experts")
    if facts.moe_layers == 0:  # a model with MoE layers is the JAX worker's, which reports its layout
        raise invalid("the served model has no MoE layers: it routes to no experts ('return_routed_experts')",
                      "return_routed_experts")
    return facts.num_hidden_layers, facts.num_experts_per_tok


def routed_fields(rows: protocol.Array | None, start_len: int, layout: tuple[int, int]) -> dict:
    """The response fields of one request's routed experts (none came: zero rows)."""
    data, shape = (b"", (0, *layout)) if rows is None else (rows.data, rows.shape)
    if rows is not None and rows.dtype != "<i4":  # the detokenizer sends little-endian int32
        raise ApiError(500, f"routed experts arrived as {rows.dtype}, not little-endian int32")
    return {"routed_experts": base64.b64encode(data).decode("ascii"), "routed_experts_shape": list(shape),
            "routed_experts_dtype": "int32", "routed_experts_start_len": start_len}
