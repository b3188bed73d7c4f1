"""The exact mode (exact_on_policy=true): the RL trainer's log-probs equal the engine's bit for bit.

The engine samples with its batch-invariant kernels, paged attention over its KV blocks and its sampler's
tempered log_softmax; in the exact mode the trainer computes its forward the same way (the packed group rows
laid out as the engine's paged cache, group_packing.paged_layout). So the log-probs of the sampled tokens are
equal (==) on every counted token, for f32 weights and for packed Q4_1 ones (QLoRA) alike, the first
iteration's importance ratio is exactly 1 on every token (nothing clipped, no weight but 1) and the logged
mismatch is 0. Without the mode, the same tiny f32 model differs from the engine by rounding (< 1e-3, see
test_rl.py); the Q4_1 one by the int8 activations too.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from tests.train.test_rl import COMMON, grpo, prompts  # noqa: F401 (prompts: a module fixture)
from tests.train.test_train_cli import cli
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.models.lora import LoRALinear
from tunix_rt.train import run as run_module
from tunix_rt.train.config import GRPOConfig, PPOConfig, build_config
from tunix_rt.train.group_packing import paged_layout
from tunix_rt.train.metrics import read_metrics
from tunix_rt.train.rl_trainer import RLTrainer, completion_logprobs

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def q4_1(root, tiny):
    q = root / "tiny_q4_1"
    assert cli("quantize", "--model", tiny, "--format", "q4_1", "--output", q) == 0
    return q


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
@pytest.mark.parametrize("weights", ["f32", "q4_1"])
def test_trainer_logprobs_equal_the_engines(tiny, q4_1, prompts, root, weights, algo):  # noqa: F811
    model_dir = tiny if weights == "f32" else q4_1
    config = GRPOConfig if algo == "grpo" else PPOConfig
    cfg = build_config(config, overrides=[*COMMON, "exact_on_policy=true", "temperature=0.7", "lora_rank=4",
                                          "num_iterations=2", "save_steps=2"],
                       model=str(model_dir), data=prompts, output=str(root / f"exact_{weights}_{algo}"),
                       reward=["brevity"])
    loaded = load_model(cfg.model)
    trainer = RLTrainer(cfg, loaded.model, run_module.build_objective(cfg, loaded, cfg.data))
    batch = {k: v[0] for k, v in trainer.train_batch(0).items()}
    mask = np.asarray(batch["loss_mask"]) > 0
    assert mask.sum() > 20
    graphdef, state = nnx.split(trainer.model())
    ours = np.asarray(jax.jit(lambda state: trainer.objective.logprobs(nnx.merge(graphdef, state), batch)[0])(state))
    engine = np.asarray(batch["sampler_logps"])
    np.testing.assert_array_equal(ours[mask], engine[mask])
    if algo == "ppo":  # its old log-probs come from the scoring pass: the trainer's, which are the engine's
        np.testing.assert_array_equal(np.asarray(batch["old_logps"])[mask], engine[mask])
    trainer._rollout = None  # run the step on a fresh rollout, so it reports the mismatch
    metrics = trainer.run_step(0)
    assert metrics["mismatch/logp_abs_max"] == 0.0 and metrics["mismatch/kl"] == 0.0
    assert metrics["importance_sampling/weight_min"] == metrics["importance_sampling/weight_max"] == 1.0
    assert metrics["clip_ratio"] == 0.0


def test_a_run_logs_no_mismatch(tiny, prompts, root):  # noqa: F811
    out = root / "exact_run"
    grpo(tiny, prompts, out, "--steps", "2", "--lora-rank", "4", "exact_on_policy=true", "learning_rate=1e-3")
    for r in read_metrics(out):
        assert r["mismatch/logp_abs_max"] == 0.0 and r["mismatch/logp_abs_mean"] == 0.0
        assert r["importance_sampling/weight_min"] == r["importance_sampling/weight_max"] == 1.0


@pytest.mark.parametrize("extra, message", [
    (("compute_dtype=bfloat16",), "exact_on_policy needs compute_dtype=float32"),
    (("top_k=5",), "exact_on_policy needs top_k=0, top_p=1 and min_p=0"),
])
def test_exact_mode_refuses_what_it_cannot_match(tiny, prompts, root, extra, message):  # noqa: F811
    with pytest.raises(ValueError, match=message):
        build_config(GRPOConfig, overrides=[*COMMON, "exact_on_policy=true", *extra], model=str(tiny), data=prompts,
                     output=str(root / "refused"), reward=["brevity"])


def test_exact_mode_refused_off_the_native_cpu_kernels(tiny, prompts, root, monkeypatch, capsys):  # noqa: F811
    """Off the CPU FFI kernels (another backend, or TUNIX_RT_KERNELS other than native) XLA's dots sum in an
    order that depends on the batch: the exact mode is refused with the reason, before any step runs."""
    from tunix_rt.models import batch_invariant
    from tunix_rt.ops import _ffi

    assert batch_invariant.unavailable_reason() is None
    monkeypatch.setattr(_ffi, "kernel_mode", lambda: "interpret")
    assert "TUNIX_RT_KERNELS=interpret" in batch_invariant.unavailable_reason()
    out = root / "refused_off_cpu"
    assert cli("grpo", "--model", tiny, "--data", prompts, "--output", out, "--reward", "brevity", "--steps", "1",
               *COMMON, "exact_on_policy=true") == 2
    assert ("exact_on_policy=true needs the row-invariant CPU kernels, and TUNIX_RT_KERNELS=interpret takes XLA's "
            "dots" in capsys.readouterr().err)
    assert not (out / "final").exists()


def test_paged_layout_gives_each_completion_the_prompt():
    """Two groups, G = 3, block size 4: prompts of 6 and 8 tokens (a partly filled last block, and none)."""
    seg = np.array([[-1] * 6 + [1, 1, 2, 2, 2, 3] + [0] * 4, [-1] * 8 + [1, 2, 2, 3, 3, 3] + [0] * 2])
    pos = np.array([list(range(6)) + [6, 7, 6, 7, 8, 6] + [-1] * 4, list(range(8)) + [8, 8, 9, 8, 9, 10] + [-1] * 2])
    lay = paged_layout(seg, pos, 3, 4)
    width = 4  # ceil(16 / 4)
    slots, seq, tables = lay["paged_slots"], lay["paged_seq"], lay["paged_tables"]
    for r in range(2):
        p = int((seg[r] == -1).sum())
        cache = {}  # slot -> token index: where each token's k/v lands, copies included
        for t in np.flatnonzero(slots[r] >= 0):
            cache[int(slots[r, t])] = t
        for src, slot in zip(lay["paged_copy_src"][r], lay["paged_copy_slots"][r]):
            if slot >= 0:
                cache[int(slot)] = int(src)
        for k in range(3):
            table = tables[r * 3 + k]
            own = np.flatnonzero(seg[r] == k + 1)
            # the sequence's positions 0..p+len-1 read the prompt's tokens, then its own
            want = list(range(p)) + list(own)
            got = [cache.get(int(table[q // 4]) * 4 + q % 4) for q in range(p + len(own))]
            assert got == want, (r, k)
            assert (seq[r, own] == k).all()
        assert (seq[r, seg[r] == -1] == 0).all() and (slots[r, pos[r] < 0] == -1).all()
        assert slots[r].max() < (1 + 3) * width * 4



def test_exact_gradient_is_the_usual_ones(tiny, prompts, root):  # noqa: F811
    """The exact mode changes the numbers of the forward, not the function: its gradient (the paged forward's,
    through the training attention's backward) is the default path's up to rounding."""
    cfg = build_config(GRPOConfig, overrides=[*COMMON, "exact_on_policy=true", "temperature=0.7", "lora_rank=4"],
                       model=str(tiny), data=prompts, output=str(root / "exact_grad"), reward=["brevity"])
    loaded = load_model(cfg.model)
    trainer = RLTrainer(cfg, loaded.model, run_module.build_objective(cfg, loaded, cfg.data))
    batch = {k: v[0] for k, v in trainer.train_batch(0).items()}
    model = trainer.model()
    for _, m in nnx.iter_modules(model):  # B = 0 at the start would leave A's gradient 0 either way
        if isinstance(m, LoRALinear):
            m.lora_b.set_value(jax.random.normal(jax.random.key(0), m.lora_b[...].shape) * 0.05)
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    mask = batch["loss_mask"]

    def loss(lora, block_size):
        logps = completion_logprobs(nnx.merge(graphdef, lora, rest), batch, 0.7, block_size=block_size)[0]
        return (logps * mask).sum()

    exact = jax.jit(jax.grad(lambda p: loss(p, trainer.objective.exact_block_size)))(lora)
    usual = jax.jit(jax.grad(lambda p: loss(p, None)))(lora)
    for a, b in zip(jax.tree.leaves(exact), jax.tree.leaves(usual)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4)
