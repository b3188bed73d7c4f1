"""Reward models (train/reward.py): the Bradley-Terry loss with margin and centring against NumPy, a run through
`tunix-rt reward` on a tiny model that learns a synthetic preference and exports a sequence classifier that
transformers loads with the same scores, and the options' and rows' errors."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.models.hf_tiny import make_tiny_model_dir
from tests.train.test_train_cli import cli
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.train.config import RewardConfig
from tunix_rt.train.data import DataError, PreferenceExample, load_preferences
from tunix_rt.train.reward import RewardObjective, attach_score_head, pack_pairs, packed_rewards, packed_rows, pair_layout
from tunix_rt.train.trainer import LossContext

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile-bound (conftest.fast_compiles says when)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _pairs(n: int, seed: int) -> list[dict]:
    """Chosen replies end with "please", rejected ones with "now": a preference the text alone decides."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        ask = "".join(rng.choice(list("abcdefgh"), 5))
        rows.append({"prompt": [{"role": "user", "content": f"do {ask}"}],
                     "chosen": [{"role": "assistant", "content": f"{ask} please"}],
                     "rejected": [{"role": "assistant", "content": f"{ask} now"}],
                     "margin": float(rng.integers(0, 2))})
    return rows


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward")
    make_tiny_model_dir(root / "model", "llama")
    return root


def _numpy_loss(chosen, rejected, margin, center):
    z = chosen - rejected - margin
    losses = np.log1p(np.exp(-z)) + (center or 0.0) * (chosen + rejected) ** 2
    return losses.sum()


def _alone(model, ids):
    """A sequence's score on a row of its own (Decoder.sequence_scores: HF's reading rule)."""
    tokens, positions = jnp.asarray(np.asarray(ids)[None]), jnp.arange(len(ids))[None]
    h, _ = model.hidden_states(tokens, positions)
    return float(model.sequence_scores(h, tokens, positions)[0, 0])


@pytest.mark.parametrize("center,rows", [(None, 1), (0.01, 2)])
def test_loss_and_metrics_match_numpy(tiny, center, rows):
    loaded = load_model(tiny / "model")
    path = _write(tiny / f"pairs{center}.jsonl", _pairs(6, 0))
    pairs = load_preferences(path, loaded.tokenizer, max_length=64)
    pairs[2] = pairs[2]._replace(rejected_ids=pairs[2].rejected_ids[:0])  # an empty reply: read in the prompt
    # the pad id is the first chosen reply's last token: that row is read one token before it, as HF reads
    model = attach_score_head(loaded.model, int(pairs[0].chosen_ids[-1]), seed=3)
    objective = RewardObjective(pairs, max_length=64, pad_id=0, center_rewards_coefficient=center, rows=rows)
    idx = np.arange(6)
    valid = np.array([1, 1, 1, 1, 1, 0], bool)
    batch = objective.host_batch(idx, valid, objective.batch_lengths(idx))
    assert batch["tokens"].shape[0] == rows
    device = {k: jnp.asarray(v) for k, v in batch.items()}
    r = np.asarray(packed_rewards(model, device))
    # the prompt once, both replies behind it, pairs end to end: each score as the pair's rows alone give it
    want = [_alone(model, np.r_[p.prompt_ids, getattr(p, side)]) for side in ("chosen_ids", "rejected_ids")
            for p in pairs]
    np.testing.assert_allclose(r, want, rtol=1e-4, atol=1e-5)
    assert batch["tokens"].size < sum(len(p.prompt_ids) * 2 + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
    loss, weight, metrics = objective.loss(LossContext(model, None, lambda: None), device)
    chosen, rejected, margin = r[:6][valid], r[6:][valid], batch["margin"][valid]
    np.testing.assert_allclose(float(loss), _numpy_loss(chosen, rejected, margin, center), rtol=1e-5)
    assert float(weight) == 5
    assert float(metrics["accuracy"]) == np.sum(chosen > rejected)
    np.testing.assert_allclose(float(metrics["margin"]), np.sum(chosen - rejected), rtol=1e-5, atol=1e-6)
    grads = jax.grad(lambda k: jnp.sum(model.score.kernel.get_value() * k))(model.score.kernel.get_value())
    assert grads.shape == (model.config.hidden_size, 1)


def test_a_sequence_with_nothing_readable_is_read_at_its_first_token(tiny):
    """All of a sequence's tokens are the pad id: HF (and sequence_scores) read its first token; packed, that is
    its own prompt's first token, not the row's."""
    loaded = load_model(tiny / "model")
    model = attach_score_head(loaded.model, 3, seed=1)
    normal = PreferenceExample(np.array([1, 40, 41], np.int32), np.array([42, 43], np.int32), np.array([44], np.int32))
    padded = PreferenceExample(np.array([3, 3], np.int32), np.array([3], np.int32), np.array([], np.int32))
    batch = pack_pairs([normal, padded], 1, 32, max_length=16, pad_id=0)
    r = np.asarray(packed_rewards(model, {k: jnp.asarray(v) for k, v in batch.items()}))
    want = [_alone(model, np.r_[p.prompt_ids, getattr(p, side)]) for side in ("chosen_ids", "rejected_ids")
            for p in (normal, padded)]
    np.testing.assert_allclose(r, want, rtol=1e-4, atol=1e-5)


def test_packed_rows():
    assert packed_rows(8, 1, 128) == 1 and packed_rows(8, 2, 128) == 2  # one row per data shard
    assert packed_rows(8, 1, 1024) == 4  # rows of at most ROW_TOKENS: two pairs of 2 x 1024
    assert packed_rows(6, 1, 1024) == 3 and packed_rows(8, 1, 4096) == 8  # dividing the batch; a pair alone
    assert packed_rows(12, 2, 1024) == 6


def test_pairs_cut_as_rows_of_their_own():
    """A prompt longer than max_length is cut there and both replies dropped; a reply is cut where prompt +
    reply reaches max_length (tokenize_preference's cut)."""
    pair = PreferenceExample(np.arange(1, 9, dtype=np.int32), np.arange(20, 25, dtype=np.int32),
                             np.arange(30, 32, dtype=np.int32))
    prompt, chosen, rejected = pair_layout(pair, 10)
    assert (len(prompt), len(chosen), len(rejected)) == (8, 2, 2)
    prompt, chosen, rejected = pair_layout(pair, 6)
    assert (len(prompt), len(chosen), len(rejected)) == (6, 0, 0)
    batch = pack_pairs([pair, pair], 1, 32, max_length=10, pad_id=0)
    np.testing.assert_array_equal(batch["segment_ids"][0, :24], [-1] * 8 + [1, 1, 2, 2] + [-2] * 8 + [65537] * 2
                                  + [65538] * 2)
    np.testing.assert_array_equal(batch["positions"][0, :12], [*range(8), 8, 9, 8, 9])
    np.testing.assert_array_equal(batch["score_segment"], [1, 65537, 2, 65538])
    with pytest.raises(ValueError, match="split evenly"):
        pack_pairs([pair] * 3, 2, 32, max_length=10, pad_id=0)


@pytest.fixture(scope="module")
def trained(tiny):
    """A reward model trained through the CLI (it prefers replies ending with "please")."""
    train = _write(tiny / "train.jsonl", _pairs(64, 1))
    held = _write(tiny / "held.jsonl", _pairs(32, 2))
    out = tiny / "run"
    assert cli("reward", "--model", tiny / "model", "--data", train, "--output", out, "--steps", 30,
               "batch_size=8", "learning_rate=3e-3", "max_length=64", f"eval_data={held}", "eval_steps=30",
               "progress=false") == 0
    return out


def test_reward_cli_learns_and_exports_a_classifier(trained):
    out = trained
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["eval_accuracy"] >= 0.9, metrics[-1]
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    back = transformers.AutoModelForSequenceClassification.from_pretrained(out / "final").eval()
    assert back.config.num_labels == 1 and type(back).__name__ == "LlamaForSequenceClassification"
    ours = load_model(out / "final").model
    tokens = np.array([[1, 40, 41, 42, 43, 3, 3], [1, 50, 51, 52, 53, 54, 55]])
    positions = np.where(np.arange(7) < np.array([[5], [7]]), np.arange(7), -1)
    h, _ = ours.hidden_states(jnp.asarray(tokens), jnp.asarray(positions))
    with torch.no_grad():
        want = back(torch.tensor(tokens), attention_mask=torch.tensor((positions >= 0).astype(np.int64))).logits
    np.testing.assert_allclose(np.asarray(ours.sequence_scores(h, jnp.asarray(tokens), jnp.asarray(positions))),
                               want.numpy(), atol=1e-4)


def test_bad_options_and_rows(tiny):
    with pytest.raises(ValueError, match="center_rewards_coefficient"):
        RewardConfig(model="m", data="d", output="o", center_rewards_coefficient=-1.0)
    assert RewardConfig(model="m", data="d", output="o", lora_rank=8).save_merged  # the head needs the merge
    loaded = load_model(tiny / "model")
    row = {**_pairs(1, 0)[0], "margin": "big"}
    with pytest.raises(DataError, match='field "margin" must be a finite number'):
        load_preferences(_write(tiny / "bad.jsonl", [row]), loaded.tokenizer, max_length=64)
    classifier = attach_score_head(loaded.model, None)
    with pytest.raises(ValueError, match="no vocabulary head"):
        classifier.output_head()


def test_a_reward_model_as_a_grpo_reward(tiny, trained, tmp_path):
    """--reward-model scores completions in-process beside the reward functions (its own chat template renders
    each conversation); a causal LM is refused as one."""
    from tunix_rt.train.reward_model_reward import RewardModelReward

    reward = RewardModelReward(str(trained / "final"))
    prompt = [{"role": "user", "content": "do abcde"}]
    polite, rude = reward([prompt, prompt], [[{"role": "assistant", "content": "abcde please"}],
                                             [{"role": "assistant", "content": "abcde now"}]])
    assert polite > rude
    assert reward(["do x: "], ["x please"])[0] == pytest.approx(reward(["do x: x please"], [""])[0], abs=1e-6)
    with pytest.raises(ValueError, match="not a reward model"):
        RewardModelReward(str(tiny / "model"))
    prompts = _write(tmp_path / "prompts.jsonl", [{"prompt": [{"role": "user", "content": f"do {c}"}]}
                                                  for c in ("abc", "bcd", "cde", "def")])
    out = tmp_path / "grpo"
    assert cli("grpo", "--model", tiny / "model", "--data", prompts, "--output", out, "--reward", "brevity",
               "--reward-model", trained / "final", "--steps", 2, "batch_size=8", "num_generations=4",
               "max_completion_length=8", "reward_weights=[0.5,1.0]", "progress=false") == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "rewards/reward_model:run/final/mean" in metrics[-1] and "rewards/brevity/mean" in metrics[-1]


def test_best_of_n_by_a_reward_model(tiny, trained, capsys):
    """generate --n N --select reward:PATH: N samples of one prompt, the one the reward model scores highest."""
    capsys.readouterr()
    assert cli("generate", "--model", tiny / "model", "--prompt", "do abcde", "--chat", "--n", 4, "--temperature",
               1.0, "--max-tokens", 6, "--select", f"reward:{trained / 'final'}", "--json") == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(result["samples"]) == 4 and len(result["scores"]) == 4
    assert result["selected"] == int(np.argmax(result["scores"]))
    assert result["text"] == result["samples"][result["selected"]]
    assert cli("generate", "--model", tiny / "model", "--prompt", "x", "--n", 2, "--select", "best") == 2


def test_majority_vote():
    from tunix_rt.evaluation.selection import by_majority

    chosen = by_majority(["so the answer is 12.0", "#### 12", "I think 13", "no idea"])
    assert chosen.index == 0 and chosen.scores == [2.0, 2.0, 1.0, 0.0]
    assert by_majority(["nothing", "here"]).index == 0


def test_ppo_critic_starts_from_the_reward_model(tiny, trained, tmp_path):
    from tunix_rt.train import run as run_module
    from tunix_rt.train.config import PPOConfig

    with pytest.raises(ValueError, match="give --reward-model"):
        PPOConfig(data="d", output="o", reward=("brevity",), value_model_init="reward")
    prompts = _write(tmp_path / "prompts.jsonl", [{"prompt": f"do {c}"} for c in ("abc", "bcd")])
    cfg = PPOConfig(model=str(tiny / "model"), data=str(prompts), output=str(tmp_path / "o"),
                    reward_model=(str(trained / "final"),), value_model_init="reward", batch_size=2,
                    max_completion_length=4, progress=False)
    loaded = load_model(tiny / "model")
    run_module._ppo(cfg, loaded, str(prompts))
    want = np.asarray(load_model(trained / "final").model.score.kernel.get_value())
    np.testing.assert_array_equal(np.asarray(loaded.model.value_head.kernel.get_value()), want)
