"""The worker: runs the scheduler's Steps on the device (engine.py) or as a fake (fake.py).

Shape letters, one meaning each across worker_svc: docs/style.md's legend, then the worker's own.

  B  batch: the scheduler's max running requests, one slot each (StepSeq.slot; engine.last [B])
  T  tokens of a step (its bucket's)         S  kv length
  N  query heads   K  kv heads   G  query heads per kv head (N / K)   H  head dim
  D  model dim     F  mlp dim    E  experts   V  vocab   L  layers
  P  pages of the KV cache       Z  tokens per page (page_size): the cache is [L, P, Z, K, H]
  Y  KV cache slots (P * Z): the routed experts buffer is [Y, L, k] (routed.py)
  W  (token, page) pairs of cached context a step reads
  O  pages in each token's page list (Buckets.max_pages): the other way a step reads its cache
  R  sampled rows, min(T, B) per bucket; a function shared with prompt scoring takes its T entries as rows
  A  alternatives per token (top logprobs): min(MAX_TOP_LOGPROBS, V) on the device (the wide
     executables': server.max_logprobs', executables.py), the step's largest top_logprobs in a StepResult
  M  banned tokens per row (MAX_BANNED_TOKENS)
  I  token ids whose logprobs a row returns (token_ids_logprob): MAX_TOKEN_IDS_LOGPROB on the device,
     the step's (or the request's) most in a StepResult (PromptScores)
  C  a chunk's length (attention: PAIR_CHUNK pairs; sampling: vocabulary entries), J  chunks
  U  a step's tokens again, as the keys' axis when they attend each other (attention)
  k  experts per token, X = T * k expert assignments, Q devices the experts are split over (moe)
"""
