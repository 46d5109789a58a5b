"""GRPO (Shao et al., 2024) against a running jaxstream server, on the tiny random Qwen3-MoE:

    jaxstream up model=qwen3_moe_tiny          # random weights of its own (path: null)
    python -m examples.grpo.train --url http://127.0.0.1:8000

1. The trainer draws its own random weights (seeded) and pushes them (/update_weights_from_tensor,
   jaxstream.rl.push_weights), after checking its tensor names and shapes against /list_weights.
2. Each round: rollouts through POST /generate, a batch of prompts with G samples each (one GRPO
   group), temperature 1, a seed per sample, with the served logprobs and, when the server gives
   them, the routed experts (`return_routed_experts`; refused: the trainer routes itself, and says so).
3. Reward, verifiable and toy: the fraction of completion tokens in a target set, 1/16 of the
   vocabulary. A random set could not be learned in a few rounds: the policy gradient raises only
   the tokens sampled, a handful of 49152. So the set has structure the model can reach at once:
   the ids whose initial embedding row points most along a seeded direction u. With the LM head
   tied, turning the final hidden state toward u raises all of them together. The embedding is
   drawn with std 0.2 (the worker's dummy draw: 0.02), so logits spread (std ~1.6, not ~0.16)
   enough for that turn to move much probability: in trials the reward rose from ~0.05 to
   0.2-0.8 within four rounds, where std 0.02 stayed below 0.1.
4. Advantages normalized within each group; the on-policy check: the trainer's logprobs of the
   rollout tokens under its pre-update weights (replaying the served routing) against the served
   ones, max |difference| reported per round. Then a few optimizer steps (adam) on the PPO-clipped
   ratio loss over the completion tokens, with the recomputed logprobs as the old policy.
5. Push the new weights as version `round-{r}`; the next rollout must report that version.

With `--lora RANK` the base stays frozen: step 1 pushes it once (version `base`), and the trainer
trains only a LoRA adapter (lora.py: PEFT's init and scale, on --lora-targets) over it. Every push
after that is the adapter alone, by PEFT's names (jaxstream.rl.push_adapter, into the adapter
--lora-name; the first, as drawn, is version `init`), and the rollouts ask for it (`lora_path`).

A last rollout measures the final weights. The exit status is 1 when the reward did not rise (the
mean of the last two rollouts' rewards not above the first's) or a max |logprob difference| passed
--max-logprob-diff.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples.grpo import lora
from examples.grpo.model import Lora, Params, forward, init_params, to_hf, token_logprobs
from jaxstream import rl
from jaxstream.config import load_config
from worker_svc.models.qwen3_moe import Qwen3MoeConfig


@dataclass
class Rollouts:
    """One round's samples, prompt-major (sample i is of prompt i // G), all of one length S."""

    tokens: np.ndarray  # [B, S] prompt then completion
    served: np.ndarray  # [B, C] the server's logprob of each completion token
    routed: np.ndarray  # [B, S, L, k] the server's experts; -1: none given (the trainer routes)
    versions: set[str]  # meta_info.weight_version of every sample
    asked: bool  # whether routed experts were asked for (False once the server refused them)
    replayed: bool  # whether the server gave routed experts for every sample


# --- the server ---

# A server started with keys (docs/operations.md, "Keys"): the admin key opens every route a trainer calls,
# generation and weight pushes; the user key is enough when no admin key is set.
API_KEY = os.environ.get("JAXSTREAM_ADMIN_API_KEY") or os.environ.get("JAXSTREAM_API_KEY") or None


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"} if API_KEY else {}


def post(url: str, route: str, body: dict, timeout: float = 600.0) -> object:
    request = urllib.request.Request(url.rstrip("/") + route, json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **_headers()}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def get(url: str, route: str, timeout: float = 60.0) -> dict:
    request = urllib.request.Request(url.rstrip("/") + route, headers=_headers())
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def rollout(url: str, prompts: np.ndarray, group: int, new_tokens: int, seed: int, cfg: Qwen3MoeConfig,
            ask: bool, adapter: str | None = None) -> Rollouts:
    """G samples of each prompt [P, prompt length], under the LoRA adapter named `adapter` (None:
    the base model); asks for routed experts when `ask`, and does without when the server refuses them."""
    params = [{"n": group, "temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True, "seed": seed + p * group}
              for p in range(len(prompts))]  # sample j of prompt p draws with seed + p * G + j
    body = {"input_ids": prompts.tolist(), "sampling_params": params, "return_logprob": True}
    if adapter is not None:
        body["lora_path"] = [adapter] * len(prompts)  # SGLang's field: one per prompt of a batch
    try:
        outs = post(url, "/generate", {**body, "return_routed_experts": True} if ask else body)
    except urllib.error.HTTPError as e:
        if not ask or e.code != 400 or "routed_experts" not in (message := e.read().decode(errors="replace")):
            raise
        print(f"the server returns no routed experts ({json.loads(message)['error']['message']}): "
              "the trainer routes with its own top-k", flush=True)
        outs, ask = post(url, "/generate", body), False
    for i, out in enumerate(outs):
        served_ids = [token for _, token, _ in out["meta_info"]["output_token_logprobs"]]
        if len(out["output_ids"]) != new_tokens or served_ids != out["output_ids"]:
            raise SystemExit(f"sample {i}: {len(out['output_ids'])} tokens of {new_tokens} (finish "
                             f"{out['meta_info']['finish_reason']}), or its logprobs name other tokens")
    seq = prompts.shape[1] + new_tokens
    tokens = np.stack([np.concatenate([prompts[i // group], out["output_ids"]]) for i, out in enumerate(outs)])
    served = np.array([[lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] for out in outs], np.float32)
    experts = np.stack([routed_experts(out["meta_info"], seq, cfg) for out in outs])
    replayed = all(out["meta_info"].get("routed_experts") is not None for out in outs)
    return Rollouts(tokens, served, experts, {out["meta_info"]["weight_version"] for out in outs}, ask, replayed)


def routed_experts(meta: dict, seq: int, cfg: Qwen3MoeConfig) -> np.ndarray:
    """A sample's R3 export (`meta_info.routed_experts`: base64 of little-endian int32, of shape
    `routed_experts_shape` = [S - 1, L, k]: the last token never ran) -> [S, L, k], -1 where
    nothing was given (the last token; every row when the server gave none)."""
    out = np.full((seq, cfg.layers, cfg.top_k), -1, np.int32)
    if meta.get("routed_experts") is None:
        return out
    ids = np.frombuffer(base64.b64decode(meta["routed_experts"]), "<i4").reshape(meta["routed_experts_shape"])
    out[meta.get("routed_experts_start_len", 0) : len(ids) + meta.get("routed_experts_start_len", 0)] = ids
    return out


def check_names(url: str, tensors: dict[str, np.ndarray]) -> None:
    """The push must name exactly the server's tensors, in their shapes: fail before the first push."""
    served = {w["name"]: tuple(w["shape"]) for w in rl.list_weights(url, api_key=API_KEY)}
    ours = {name: t.shape for name, t in tensors.items()}
    if served != ours:
        diff = sorted(set(served.items()) ^ set(ours.items()))[:10]
        raise SystemExit(f"the trainer's tensors differ from the server's /list_weights: {diff}")


# --- GRPO ---


def target_ids(params: Params, fraction: float, seed: int) -> np.ndarray:
    """The reward's target set: the `fraction` of ids whose initial embedding row projects most on
    a seeded random direction (see the module docstring). A bool mask [V]."""
    table = np.asarray(params["embed.table"])
    direction = np.random.default_rng(seed).standard_normal(table.shape[1])
    projection = table @ direction
    return projection >= np.quantile(projection, 1.0 - fraction)


def rewards(completions: np.ndarray, target: np.ndarray) -> np.ndarray:
    """[B, C] token ids -> [B]: the fraction of each completion's tokens in the target set."""
    return target[completions].mean(axis=1)


def advantages(reward: np.ndarray, group: int) -> np.ndarray:
    """GRPO's: each sample's reward less its group's mean, over the group's standard deviation."""
    r = reward.reshape(-1, group)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)).reshape(-1)


def completion_logprobs(params: Params, adapter: Lora | None, cfg: Qwen3MoeConfig, tokens: jax.Array, routed: jax.Array,
                        completion: int, page_size: int) -> jax.Array:
    """tokens [B, S], routed [B, S, L, k] -> the logprob of each completion token [B, C], under
    `params` and the LoRA `adapter` (None: none). One sequence at a time (lax.map, not vmap): a
    batch axis would change every matmul's shape, and with it the served numbers' order of sums."""

    def one(sample):
        tokens, routed = sample
        logits, _ = forward(params, cfg, tokens, routed, page_size, adapter)
        return token_logprobs(logits[-completion - 1 : -1], tokens[-completion:])

    return jax.lax.map(one, (tokens, routed))


def grpo_loss(params: Params, adapter: Lora | None, cfg: Qwen3MoeConfig, page_size: int, tokens, routed, old, adv,
              clip: float) -> jax.Array:
    """The PPO-clipped ratio objective over every completion token, negated; no KL term."""
    lp = completion_logprobs(params, adapter, cfg, tokens, routed, old.shape[1], page_size)  # [B, C]
    ratio = jnp.exp(lp - old)
    gain = jnp.minimum(ratio * adv[:, None], jnp.clip(ratio, 1 - clip, 1 + clip) * adv[:, None])
    return -gain.mean()


class Trainer:
    """The trained weights (`params`: the model's, or with `adapter` (its initial weights, its scale)
    an adapter's over the frozen `base`), adam's state over them, and the two compiled functions: the
    logprobs of a batch's completions, and the loss's gradient (of the trained weights alone)."""

    def __init__(self, cfg: Qwen3MoeConfig, params: Params, lr: float, clip: float, page_size: int,
                 adapter: tuple[lora.Weights, float] | None = None) -> None:
        self.base, self.params = (None, params) if adapter is None else (params, adapter[0])
        self.optimizer = optax.adam(lr)
        self.state = self.optimizer.init(self.params)

        def model(trained, base):  # -> (the model's parameters, the adapter or None)
            return (trained, None) if base is None else (base, Lora(trained, adapter[1]))

        self._logprobs = jax.jit(lambda p, b, t, r, c: completion_logprobs(*model(p, b), cfg, t, r, c, page_size),
                                 static_argnums=4)
        self.grad = jax.jit(jax.value_and_grad(lambda p, b, t, r, o, a: grpo_loss(*model(p, b), cfg, page_size, t, r, o, a, clip)))

    def logprobs(self, tokens, routed, completion: int) -> jax.Array:
        """[B, C]: the current weights' logprobs of the completions (completion_logprobs)."""
        return self._logprobs(self.params, self.base, tokens, routed, completion)

    def step(self, tokens, routed, old, adv) -> float:
        loss, grads = self.grad(self.params, self.base, tokens, routed, old, adv)
        updates, self.state = self.optimizer.update(grads, self.state, self.params)
        self.params = optax.apply_updates(self.params, updates)
        return float(loss)


@dataclass
class Row:
    round: int
    reward: float  # mean over the round's samples
    logprob_diff: float  # max |trainer - served| over the round's completion tokens
    weight_version: str  # the rollouts' meta_info.weight_version
    loss: float  # after the round's last optimizer step; nan on the last, measuring, round
    seconds: float


HEADER = f"{'round':>5} {'reward':>8} {'max|lp diff|':>13} {'weight_version':>15} {'loss':>9} {'s':>5}"


def line(row: Row) -> str:
    return (f"{row.round:>5} {row.reward:>8.4f} {row.logprob_diff:>13.3e} {row.weight_version:>15} {row.loss:>9.4f} "
            f"{row.seconds:>5.1f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", default="qwen3_moe_tiny", help="the server's model config (configs/model/), for its hf_config")
    parser.add_argument("--rounds", type=int, default=4, help="rollout, update and push rounds (then one more rollout)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per rollout")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (the GRPO group)")
    parser.add_argument("--prompt-len", type=int, default=8, help="tokens per (random) prompt")
    parser.add_argument("--new-tokens", type=int, default=12, help="completion tokens per sample")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per round, on that round's rollouts")
    parser.add_argument("--lr", type=float, default=3e-2, help="adam's learning rate")
    parser.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip")
    parser.add_argument("--embed-std", type=float, default=0.2, help="std of the initial embedding (see step 3)")
    parser.add_argument("--target-fraction", type=float, default=1 / 16, help="share of the vocabulary the reward counts")
    parser.add_argument("--seed", type=int, default=0, help="weights, prompts, target set and sampling seeds")
    parser.add_argument("--max-logprob-diff", type=float, default=None,
                        help="fail when max |trainer - served logprob| exceeds it (0 with the batch-invariant mode)")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="train and push only a LoRA adapter of this rank over the frozen base (0: the full weights)")
    parser.add_argument("--lora-alpha", type=float, default=None, help="the adapter's alpha (scale alpha / rank); default: the rank")
    parser.add_argument("--lora-targets", default=",".join(lora.ATTENTION),
                        help="the projections the adapter adapts, of q,k,v,o (and gate,up,down: dense layers only)")
    parser.add_argument("--lora-name", default="grpo", help="the adapter's name on the server: pushed into, asked for")
    args = parser.parse_args(argv)
    if args.lora < 0:
        parser.error(f"--lora: a rank must be >= 1 (0: no adapter), got {args.lora}")
    args.lora_alpha = float(args.lora if args.lora_alpha is None else args.lora_alpha)
    args.lora_targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    unknown = [t for t in args.lora_targets if t not in lora.PEFT_MODULES]
    if unknown or not args.lora_targets:
        parser.error(f"--lora-targets: {unknown or 'nothing'} is not some of {list(lora.PEFT_MODULES)}")
    return args


def push(url: str, trainer: Trainer, cfg: Qwen3MoeConfig, args: argparse.Namespace, version: str) -> None:
    """The trained weights to the server as `version`: the whole model's, or the adapter's alone."""
    if not args.lora:
        rl.push_weights(url, to_hf(trainer.params, cfg), weight_version=version, api_key=API_KEY)
        return
    try:
        rl.push_adapter(url, args.lora_name, lora.to_peft(trainer.params, cfg), rank=args.lora, alpha=args.lora_alpha,
                        target_modules=[lora.PEFT_MODULES[t] for t in args.lora_targets], weight_version=version, api_key=API_KEY)
    except rl.WeightPushError as e:  # e.g. a server without a slot of that rank on those modules: its message names it
        raise SystemExit(f"--lora: the server refused the adapter ({e}); it needs worker.lora.max_adapters >= 1, "
                         f"max_rank >= {args.lora} and target_modules {list(args.lora_targets)}") from None


def run(args: argparse.Namespace) -> tuple[list[Row], bool]:
    """The loop (module docstring); prints the table as it goes. Returns its rows and whether the
    server's routing was replayed."""
    cfg = Qwen3MoeConfig.from_hf(dict(load_config([f"model={args.model}"]).model.hf_config))
    page_size = get(args.url, "/get_server_info")["page_size"]  # attention's blocks of summation
    params = init_params(cfg, args.seed, args.embed_std)
    adapter = (lora.init(cfg, args.lora, args.lora_targets, args.seed), lora.scale(args.lora, args.lora_alpha)) if args.lora else None
    trainer = Trainer(cfg, params, args.lr, args.clip, page_size, adapter)
    target = target_ids(params, args.target_fraction, args.seed)
    prompts = np.random.default_rng(args.seed).integers(0, cfg.vocab, (args.prompts, args.prompt_len), dtype=np.int64)
    tensors = to_hf(params, cfg)
    check_names(args.url, tensors)
    rl.push_weights(args.url, tensors, weight_version="base" if args.lora else "init", api_key=API_KEY)
    if args.lora:  # the base stays; from here on only the adapter moves
        push(args.url, trainer, cfg, args, "init")

    rows, version, ask, replayed = [], "init", True, True
    print(HEADER, flush=True)
    for r in range(args.rounds + 1):  # the last round only measures the final weights
        started = time.monotonic()
        batch = rollout(args.url, prompts, args.group, args.new_tokens, args.seed + 1_000_000 * (r + 1), cfg, ask,
                        args.lora_name if args.lora else None)
        ask, replayed = batch.asked, replayed and batch.replayed
        if batch.versions != {version}:
            raise SystemExit(f"round {r}: the rollouts report weight versions {sorted(batch.versions)}, not {version!r}")
        reward = rewards(batch.tokens[:, -args.new_tokens :], target)
        tokens, routed = jnp.asarray(batch.tokens, jnp.int32), jnp.asarray(batch.routed)
        old = trainer.logprobs(tokens, routed, args.new_tokens)  # the on-policy check, before any step
        diff = float(np.abs(np.asarray(old) - batch.served).max())
        loss = float("nan")
        if r < args.rounds:
            adv = jnp.asarray(advantages(reward, args.group), jnp.float32)
            loss = [trainer.step(tokens, routed, old, adv) for _ in range(args.steps)][-1]
            version = f"round-{r}"
            push(args.url, trainer, cfg, args, version)
        rows.append(Row(r, float(reward.mean()), diff, sorted(batch.versions)[0], loss,
                        time.monotonic() - started))
        print(line(rows[-1]), flush=True)
    return rows, replayed


def verdict(rows: list[Row], max_logprob_diff: float | None) -> str | None:
    """Why the run failed, or None: the reward must rise (the mean of the last two rollouts above
    the first) and no round's logprob difference pass `max_logprob_diff`."""
    first, last = rows[0].reward, float(np.mean([row.reward for row in rows[-2:]]))
    if not last > first:
        return f"the reward did not rise: {first:.4f} at first, {last:.4f} over the last two rollouts"
    worst = max(row.logprob_diff for row in rows)
    if max_logprob_diff is not None and not worst <= max_logprob_diff:
        return f"max |logprob diff| {worst:.3e} is above --max-logprob-diff {max_logprob_diff}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, replayed = run(args)
    print(f"routing: {'replayed from the server' if replayed else 'the trainer own (the server gave no routed experts)'}; "
          f"reward {rows[0].reward:.4f} -> {np.mean([row.reward for row in rows[-2:]]):.4f} (mean of the last two); "
          f"max |logprob diff| {max(row.logprob_diff for row in rows):.3e}")
    failure = verdict(rows, args.max_logprob_diff)
    if failure:
        print(f"FAIL: {failure}")
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
