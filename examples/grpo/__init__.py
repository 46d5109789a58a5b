"""GRPO against a running jaxstream server: the trainer's own Qwen3-MoE (model.py) and the loop
(train.py: rollouts over HTTP, a clipped-ratio update, a hot weight push per round)."""
