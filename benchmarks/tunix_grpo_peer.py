"""The google-tunix side of a GRPO benchmark: its GRPOLearner on SmolLM2-135M (run by the peer interpreter).

Same model setup as tunix_peer.py: Tunix's Llama3 model takes SmolLM2's dimensions and the f32 weights
from an HF directory (as benchmarks exports them from the default GGUF), LoRA goes through qwix on the
same seven projections. GRPO runs through Tunix's own stack: RLCluster (actor = rollout model on one
mesh, so the vanilla sampler decodes with the trained LoRA weights, no reference model since beta = 0),
the "vanilla" rollout engine (tunix.generate.sampler.Sampler, KV cache, temperature 1, full vocabulary),
and GRPOLearner (num_generations completions per prompt, one iteration per batch, one optimizer update
per step). Prompts are raw text: the caller applies the chat template.

Step times are the intervals between the learner's requests for the next batch of prompts (the last one
ends when train() returns with the model state ready); Tunix runs rollout, advantage computation, the
update and the weight sync of one step before it asks for the next batch, so each interval is one full
GRPO step.

The reward function has TRL's signature f(prompts, completions, **kwargs); Tunix calls it with
prompts, completions, mode and trajectory_ids only, so a wrapper adds completion_ids (the sampled token
ids of each completion, as the sampler returned them: up to, not including, EOS) before calling it.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def grpo_steps(hf_dir: str, prompts: list[str], steps: int, *, prompts_per_step: int = 4, generations: int = 4,
               max_new_tokens: int = 64, rank: int = 8, alpha: float = 16.0, targets: Sequence[str] = TARGETS,
               reward_fn: Callable[..., list[float]], learning_rate: float = 1e-5, temperature: float = 1.0,
               seed: int = 0) -> dict:
    """Runs `steps` Tunix GRPO steps; returns {"times": [s per step], "lengths": [mean completion length]}."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import qwix
    import transformers
    from flax import nnx
    from tunix.models.llama3 import params as llama_params
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout
    from tunix_peer import llama_config

    if not prompts:
        raise ValueError("no prompts")
    config = llama_config(hf_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    # The sampler left-pads every prompt to max_prompt_length (after prepending BOS unless the prompt already
    # starts with it) and needs max_prompt_length + max_new_tokens cache slots: size both to the data, as
    # TRL pads to the longest prompt in the batch.
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    prompt_len = max(len(bos + tokenizer.encode(p, add_special_tokens=False)) for p in prompts)

    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with mesh:
        model = llama_params.create_model_from_safe_tensors(hf_dir, config, mesh, dtype=jnp.float32)
        provider = qwix.LoraProvider(module_path=".*(" + "|".join(targets) + ")", rank=rank, alpha=alpha)
        model = qwix.apply_lora_to_model(model, provider, **model.get_model_input())

        training_config = rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.adamw(learning_rate), eval_every_n_steps=10_000, max_steps=steps,
            pbar_description=None)
        rollout_config = base_rollout.RolloutConfig(
            max_tokens_to_generate=max_new_tokens, max_prompt_length=prompt_len,
            kv_cache_size=prompt_len + max_new_tokens, temperature=temperature, top_p=1.0, top_k=None,
            seed=seed)
        cluster_config = rl_cluster_lib.ClusterConfig(
            role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                          rl_cluster_lib.Role.ROLLOUT: mesh},
            rollout_engine="vanilla", offload_to_cpu=False, training_config=training_config,
            rollout_config=rollout_config)
        cluster = rl_cluster_lib.RLCluster(actor=model, reference=None, tokenizer=tokenizer,
                                           cluster_config=cluster_config)

    # Keep the sampled token ids of the latest rollout, for the reward's completion_ids.
    sampled: list[list[np.ndarray]] = []
    generate = cluster.generate

    def generate_and_keep(*args, **kwargs):
        out = generate(*args, **kwargs)
        sampled.append(out.tokens)
        return out

    cluster.generate = generate_and_keep
    lengths: list[float] = []

    def reward(prompts, completions, **kwargs):
        kwargs.pop("completion_ids", None)
        if sampled and len(sampled[-1]) == len(completions):
            ids = [[int(t) for t in x] for x in sampled[-1]]
        else:
            ids = [tokenizer.encode(c, add_special_tokens=False) for c in completions]
        lengths.append(float(np.mean([len(x) for x in ids])))
        return [float(r) for r in reward_fn(prompts, completions, completion_ids=ids, **kwargs)]

    reward.__name__ = getattr(reward_fn, "__name__", "reward")
    algo_config = grpo_learner.GRPOConfig(num_generations=generations, num_iterations=1, beta=0.0, epsilon=0.2)
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo_config, reward_fns=[reward])

    marks: list[float] = []

    def batches():
        for i in range(steps):
            marks.append(time.perf_counter())
            # The sampler makes PRNGKey(seed) on every call (a jax.Array seed would be donated and deleted
            # after the first): a new seed per step keeps rollouts from reusing the same random stream.
            rollout_config.seed = seed + i
            # An array, as Tunix's own data pipelines give it: the learner repeats each leaf G times.
            yield {"prompts": np.array([prompts[(i * prompts_per_step + j) % len(prompts)]
                                        for j in range(prompts_per_step)])}
        marks.append(time.perf_counter())  # only if Tunix asks past the last step

    with mesh:
        learner.train(batches())
        jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
    end = time.perf_counter()
    marks = marks[:steps] + [marks[steps] if len(marks) > steps else end]
    return {"times": [b - a for a, b in zip(marks, marks[1:])], "lengths": lengths}
