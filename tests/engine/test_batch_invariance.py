"""Batch invariance, bit for bit: a request's tokens and log-probs do not depend on the requests sharing its
steps, on how its prompt was chunked, on preemption and recompute, nor on prefix-cache hits.

For f32, bf16, and Q4_1 / Q8_0 packed weights (with a quantized tied head), twelve prompts of 1..40 tokens
run greedily and with seeded sampling (a) together on an engine whose small KV pool forces preemptions and
whose 16-token budget chunks the long prompts, (b) one at a time on that engine, (c) together on an engine
with a 64-token budget (other chunks, other neighbours), and (d) together again on the first engine, whose
prefix cache now holds every prompt's full blocks. All four give identical token ids and identical
log-probs (==, not approx). Without the batch-invariant kernels (models/batch_invariant.py) the f32 case
already differed in the last bits, and the Q4_1 case picked other tokens for 5 of the 12 prompts run
one at a time than together.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.engine.idle import assert_idle
from tunix_rt.engine.engine import Engine
from tunix_rt.engine.params import SamplingParams
from tunix_rt.models.config import FULL, ModelConfig, RopeConfig
from tunix_rt.models.decoder import Decoder
from tunix_rt.models.quant_layers import QuantEmbed, QuantLinear, quantize_stacked
from tunix_rt.ops.quant import quantize

pytestmark = pytest.mark.slow

LENGTHS = (3, 9, 14, 5, 30, 2, 11, 6, 21, 40, 7, 1)
SAMPLING = {
    "greedy": SamplingParams(max_tokens=20, temperature=0.0, logprobs=0),
    "seeded": SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=5, logprobs=0),
}


def _model(weights: str) -> Decoder:
    cfg = ModelConfig(architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rope=((FULL, RopeConfig(theta=10000.0)),),
                      tie_word_embeddings=True)
    model = Decoder(cfg, dtype=jnp.bfloat16 if weights == "bf16" else jnp.float32, rngs=nnx.Rngs(0))
    if weights in ("q4_1", "q8_0"):
        for layer in model.layers.kinds:
            for parent, names in ((layer.attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                  (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
                for name in names:  # x5: weights big enough that int8 activations move the logits
                    setattr(parent, name, QuantLinear(quantize_stacked(getattr(parent, name).kernel[...] * 5, weights)))
        model.embed = QuantEmbed(quantize(model.embed.embedding[...].T, weights), jnp.float32)
    return model


def _run(engine: Engine, prompts, params) -> list[tuple[list[int], list[float]]]:
    return [(o.token_ids, o.logprobs) for o in engine.generate(prompts, params)]


@pytest.mark.parametrize("weights", ["f32", "bf16", "q4_1", "q8_0"])
def test_outputs_do_not_depend_on_the_batch(weights):
    model = _model(weights)
    # 28 blocks of 4 hold the longest request (40 + 20 tokens) alone, not the twelve together
    small = Engine(model, None, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16, block_size=4,
                   num_kv_blocks=28, token_buckets=(8, 16))
    wide = Engine(model, None, max_model_len=64, max_num_seqs=12, max_num_batched_tokens=64, block_size=4,
                  num_kv_blocks=256, token_buckets=(16, 64))
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 97, size=n)] for n in LENGTHS]
    for name, params in SAMPLING.items():
        small.reset_prefix_cache()
        preempted = small.stats().num_preemptions
        together = _run(small, prompts, params)
        assert small.stats().num_preemptions > preempted, "the small pool should have forced a preemption"
        alone = [_run(small, [p], params)[0] for p in prompts]
        hits = small.stats().prefix_cache_hits
        again = _run(small, prompts, params)
        assert small.stats().prefix_cache_hits > hits
        other_chunks = _run(wide, prompts, params)
        assert len({len(t) for t, _ in together}) == 1 and all(lp is not None for _, lp in together)
        for i in range(len(prompts)):
            assert alone[i] == together[i], f"{weights} {name}: prompt {i} alone differs from the batch"
            assert again[i] == together[i], f"{weights} {name}: prompt {i} with prefix-cache hits differs"
            assert other_chunks[i] == together[i], f"{weights} {name}: prompt {i} chunked otherwise differs"
    assert_idle(small)
    assert_idle(wide)
