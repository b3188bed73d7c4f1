"""Agentic RL (train/agentic.py) on the tiny llama: trajectories grow as the ids the policy sampled, turn by
turn, with the template's text and the observations spliced in and masked; GRPO and PPO train on them from the
command line with the agentic metrics; bad tools and environments are one-line errors."""

from __future__ import annotations

import numpy as np
import pytest

from tests.train import agentic_envs
from tests.train.test_rl import assert_one_line_error
from tests.train.test_train_cli import cli, write_jsonl
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.tools.chat import continuation
from tunix_rt.tools.environment import environment_factory
from tunix_rt.train.agentic import AgenticSampler, Agents, agentic_sampler
from tunix_rt.train.config import GRPOConfig, build_config
from tunix_rt.train.group_packing import pack_groups
from tunix_rt.train.metrics import read_metrics
from tunix_rt.train.rewards import brevity_reward
from tunix_rt.train.rollout_engine import RolloutEngine, rollout_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fast_compiles")]

COMMON = ("batch_size=8", "num_generations=4", "max_completion_length=128", "max_turns=3", "progress=false")
STOPS = list(range(40, 60))  # ids the tiny model's turns stop on (about one token in thirteen)


@pytest.fixture(scope="module")
def rows(root):
    return write_jsonl(root / "rows.jsonl", [{"prompt": f"hi {i}", "answer": str(i)} for i in range(4)])


@pytest.fixture
def short_turns(monkeypatch):
    """The tiny model's turns stop on STOPS (its EOS is too rare), so trajectories have several turns."""
    params = AgenticSampler._params

    def with_stops(self, n, max_tokens, seed):
        p = params(self, n, max_tokens, seed)
        p.stop_token_ids = STOPS
        return p

    monkeypatch.setattr(AgenticSampler, "_params", with_stops)


def test_trained_ids_are_the_sampled_ids_turn_by_turn_with_observations_masked(tiny, rows, root, short_turns):
    loaded = load_model(tiny)
    tok = loaded.tokenizer
    cfg = build_config(GRPOConfig, model=str(tiny), data=rows, output=str(root / "unused"),
                       overrides=[*COMMON, "env=tests.train.agentic_envs:Again"])
    factory, tools = environment_factory(cfg.env, cfg.tool)
    sampler = agentic_sampler(cfg, tok, rows, [("brevity", brevity_reward)], factory, tools)
    rollout = RolloutEngine(tok, rollout_config(None, decode_and_prefill_buckets=True, max_model_len=sampler.max_model_len,
                                                max_num_seqs=8, max_num_batched_tokens=512, kv_cache_memory=8 << 20,
                                                seed=0, logprobs_mode="processed_logprobs"), seed=0)
    rollout.bind(lambda: loaded.model)
    engine = rollout.live()
    requests, turns = {}, {}  # request id -> prompt ids; (request id, index) -> the finished turn's output
    add, step = engine.add_request, engine.step

    def recording_add(prompt, params=None, request_id=None, **kw):
        rid = add(prompt, params, request_id, **kw)
        requests[rid] = list(prompt)
        return rid

    def recording_step():
        outs = step()
        turns.update({(o.request_id, o.index): o for o in outs if o.finished})
        return outs

    engine.add_request, engine.step = recording_add, recording_step
    rollout.begin(0)
    c = sampler.sample(rollout, np.arange(2))
    batch = pack_groups(c, cfg, sampler.seq_len, 0)

    assert c.stats["turns"].max() > 1, "no trajectory took a second turn"
    eos = set(tok.eos_token_ids)
    assert len(requests) == 2 + sum(c.stats["turns"] - 1)  # one n=G request per prompt, then one per later turn
    for i in range(len(c)):
        prompt = c.prompts[i].prompt_ids.tolist()
        ids, sampled = c.token_ids[i].tolist(), c.sampled[i].astype(bool)
        # the turns of trajectory i, in order: each request's prompt is the prompt and the trajectory so far
        own = sorted(((len(requests[rid]), out) for (rid, k), out in turns.items()
                      if requests[rid] == (prompt + ids)[:len(requests[rid])] and
                      (len(requests[rid]) > len(prompt) or k == i % cfg.num_generations)), key=lambda t: t[0])
        assert len(own) == c.stats["turns"][i]
        position = len(prompt)
        row = {"prompt": c.prompts[i].prompt, **c.prompts[i].columns}
        history = sampler.agents.opening(sampler.agents.make(), row, "")[0]
        for n, (length, out) in enumerate(own):
            assert length == position  # each turn's prompt: the conversation so far, verbatim
            turn = slice(position - len(prompt), position - len(prompt) + len(out.token_ids))
            assert ids[turn] == out.token_ids and sampled[turn].all()
            np.testing.assert_array_equal(c.logprobs[i][turn], out.logprobs)
            position += len(out.token_ids)
            history.append({"role": "assistant", "content": out.text})
            if n + 1 < len(own):  # spliced before the next turn: the template's text alone, tokenised alone, unsampled
                observation = [{"role": "tool", "content": f"again {n + 1}"}]
                stop = tok.decode(out.token_ids[-1:], skip_special_tokens=False) if out.token_ids[-1] in eos else ""
                text = continuation(tok, sampler.agents.format, None, history, observation, stop_text=stop)
                assert f"<tool_response>\nagain {n + 1}\n</tool_response>" in text  # the tool result, as rendered
                gap = slice(position - len(prompt), own[n + 1][0] - len(prompt))
                assert ids[gap] == tok.encode(text, add_special_tokens=False) and not sampled[gap].any()
                history += observation
                position = own[n + 1][0]
        assert position - len(prompt) == len(ids)
        # the environment's reward: one step per turn that ended on a stop token
        assert c.rewards_per_fn[1, i] == len(own) - (own[-1][1].finish_reason == "length")
        # packed for training: loss on exactly the sampled tokens, targets the ids in order
        m = len(ids)
        np.testing.assert_array_equal(batch["targets"][i, :m], ids)
        np.testing.assert_array_equal(batch["loss_mask"][i, :m], sampled.astype(np.float32))
        assert not batch["loss_mask"][i, m:].any()
        np.testing.assert_array_equal(batch["sampler_logps"][i, :m][sampled], c.logprobs[i][sampled])
    rollout.finish()


def run(tiny, rows, out, *extra, algo="grpo"):
    argv = [algo, "--model", tiny, "--data", rows, "--output", out, "--reward", "brevity", *extra, *COMMON]
    assert cli(*argv) == 0
    return read_metrics(out)


AGENTIC = ("agentic/turns", "agentic/tool_calls", "agentic/tool_call_rate", "agentic/tool_errors",
           "agentic/tool_timeouts", "agentic/tool_seconds", "agentic/prefix_cache_hit_rate",
           "time/tools")


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_grpo_and_ppo_train_on_trajectories_from_the_command_line(tiny, rows, root, short_turns, algo):
    """In the exact mode, too: the trainer's log-probs of every sampled token of every turn equal the engine's.
    Every environment made is closed."""
    closed = agentic_envs.Again.closed
    metrics = run(tiny, rows, root / f"{algo}-env", "--env", "tests.train.agentic_envs:Again", "--steps", "2",
                  "--lora-rank", "4", "num_iterations=1", "exact_on_policy=true", algo=algo)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert all(name in m for name in AGENTIC) and np.isfinite(m["loss"])
        assert 1 <= m["agentic/turns"] <= 3 and m["agentic/tool_calls"] == 0
        assert any(k.startswith("agentic/reward_turns_") for k in m)
        assert "rewards/environment/mean" in m  # the environment's own reward, beside brevity
        assert m["mismatch/logp_abs_max"] == 0 and m["importance_sampling/weight_min"] == 1.0
    assert max(m["agentic/turns"] for m in metrics) > 1
    assert metrics[-1]["agentic/prefix_cache_hit_rate"] > 0  # later turns find the conversation's KV cached
    assert agentic_envs.Again.closed - closed >= 2 * 8  # the trajectories' (and the probes' and the openings')


def test_an_environment_step_past_max_tool_time_is_given_up(tiny, rows, root, short_turns):
    metrics = run(tiny, rows, root / "sleepy", "--env", "tests.train.agentic_envs:Sleepy", "--steps", "1",
                  "max_tool_time=0.5")
    m = metrics[0]
    assert m["completions/clipped_ratio"] > 0 and m["agentic/tool_seconds"] >= 1.5 / 8 and np.isfinite(m["loss"])


def test_tools_and_an_environment_of_tools_from_the_command_line(tiny, rows, root):
    """The prompt tells the policy about the environment's own tools and the run's, and both runs train."""
    tok = load_model(tiny).tokenizer
    factory, tools = environment_factory("tests.train.agentic_envs:Calculating", ["calculator", "python"])
    opening = Agents(factory, tools, tok, 30.0).load_prompts(rows, max_prompt_length=4096)[0]
    text = tok.decode(opening.prompt_ids.tolist(), skip_special_tokens=False)
    for name in ("multiply", "calculator", "python"):
        assert f'"name": "{name}"' in text
    assert "hi 0 Use the calculator." in text and opening.prompt == "hi 0"
    # (the tools prompt is over a thousand of the tiny tokenizer's characters)
    for out, extra in [("tools", ("--tool", "calculator", "--tool", "python")),
                       ("env-tools", ("--env", "tests.train.agentic_envs:Calculating", "--tool", "calculator"))]:
        metrics = run(tiny, rows, root / out, *extra, "--steps", "1", "max_prompt_length=2048")
        assert np.isfinite(metrics[0]["loss"]) and all(name in metrics[0] for name in AGENTIC)


@pytest.mark.parametrize("extra, message", [
    (("--tool", "nonesuch"), r"--tool 'nonesuch': not a built-in"),
    (("--tool", "json:dumps"), r"--tool 'json:dumps': .*no type hint"),
    (("--env", "tests.train.agentic_envs:Nowhere"), r"--env 'tests.train.agentic_envs:Nowhere': .* no attribute"),
    (("--env", "no_such_module_xyz:Env"), r"--env 'no_such_module_xyz:Env': cannot import"),
    (("--env", "tests.train.agentic_envs:Again", "--tool", "calculator"), "must subclass"),
    (("--tool", "calculator", "max_turns=0"), "max_turns must be a positive integer"),
    (("--tool", "calculator", "max_tool_time=0"), "max_tool_time must be a positive number"),
    (("--tool", "calculator", "max_prompt_length=4"), r"rows.jsonl:1: the opening conversation has \d+ tokens"),
])
def test_bad_tools_and_environments_are_one_line_errors(tiny, rows, tmp_path, capsys, extra, message):
    assert_one_line_error(capsys, message, "--model", tiny, "--data", rows, "--output", tmp_path / "out", "--reward",
                          "brevity", *COMMON, *extra)


def test_an_environment_that_raises_stops_the_run_naming_it(tiny, rows, tmp_path, short_turns):
    with pytest.raises(RuntimeError, match="the environment's step raised KeyError: 'no such state'"):
        cli("grpo", "--model", tiny, "--data", rows, "--output", tmp_path / "out", "--reward", "brevity", "--env",
            "tests.train.agentic_envs:Broken", "--steps", "1", *COMMON)
