"""Reward functions: the built-ins, name/module:function resolution, weighted NaN-sums, and the clear
errors a reward that raises or returns the wrong thing gets."""

from __future__ import annotations

import numpy as np
import pytest

from tunix_rt.train.rewards import (
    RewardError,
    RewardScorer,
    accuracy_reward,
    answers_match,
    brevity_reward,
    extract_answer,
    format_reward,
    resolve_reward,
    score,
)


@pytest.mark.parametrize("text,answer", [
    ("so the total is \\boxed{42}.", "42"),
    ("work...\n#### 1,000", "1,000"),
    ("<think>hmm</think><answer> 7 </answer>", "7"),
    ("3 apples and 4 pears make 7", "7"),
    ("it is -2.5 degrees", "-2.5"),
    ("no digits here", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("given,expected,match", [
    ("42", "42", True), ("42.0", "42", True), ("1/2", "0.5", True), (".50", "1/2", True), ("1,000", "1000", True),
    ("$5", "5", True), ("41", "42", False), ("Paris", "paris.", True), ("Paris", "London", False),
])
def test_answers_match(given, expected, match):
    assert answers_match(given, expected) is match


def test_accuracy_reward():
    completions = ["The answer is 12.", "I think 13", "#### 12", "no idea", [{"role": "assistant", "content": "12"}]]
    answers = ["12", "12", "12", "12", "#### 12"]
    assert accuracy_reward(["p"] * 5, completions, answer=answers) == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert accuracy_reward(["p"], ["7"], solution=["\\boxed{7}"]) == [1.0]
    assert accuracy_reward(["p", "p"], ["7", "7"], ground_truth=[None, "7"]) == [None, 1.0]
    with pytest.raises(ValueError, match="reference column"):
        accuracy_reward(["p"], ["7"], completion_ids=[[1]])


def test_format_and_brevity_rewards():
    good = "<think>add them</think>\n<answer>4</answer>"
    nested = "<think><think>x</think><answer>1</answer>"
    assert format_reward([], [good, "<answer>4</answer>", good + " extra", nested]) == [1.0, 0.0, 0.0, 0.0]
    assert brevity_reward([], ["a", "b"], completion_ids=[[1] * 5, [1] * 50]) == [-0.05, -0.5]


def test_resolve_builtin_module_and_file(tmp_path):
    assert resolve_reward("math")[1] is accuracy_reward
    assert resolve_reward("tunix_rt.train.rewards:format_reward")[1] is format_reward
    path = tmp_path / "my_rewards.py"
    path.write_text("def shout(prompts, completions, **kw):\n    return [float(c.isupper()) for c in completions]\n")
    name, fn = resolve_reward(f"{path}:shout")
    assert name == f"{path}:shout" and fn([], ["HI", "hi"]) == [1.0, 0.0]


@pytest.mark.parametrize("spec,message", [
    ("nonesuch", "unknown reward 'nonesuch'"),
    ("no_such_module_xyz:f", "cannot import no_such_module_xyz"),
    ("tunix_rt.train.rewards:missing", "has no attribute 'missing'"),
    ("", "built-in name"),
])
def test_resolve_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_reward(spec)


def _const(values):
    return lambda prompts, completions, **kw: values


def test_score_weights_and_none():
    rewards = [("a", _const([1.0, None, 2.0])), ("b", _const([0.5, 0.5, None]))]
    total, per_fn = score(rewards, [1.0, 2.0], ["p"] * 3, ["x", "y", "z"], {})
    np.testing.assert_allclose(total, [2.0, 1.0, 2.0])
    assert np.isnan(per_fn[0, 1]) and np.isnan(per_fn[1, 2])


def test_scorer_weights_its_functions_and_reports_each_one():
    scorer = RewardScorer([("a", _const([1.0, None, 3.0])), ("b", _const([None, None, None]))], [2.0, 1.0])
    total, per_fn = scorer(["p"] * 3, ["x", "y", "z"], {})
    np.testing.assert_allclose(total, [2.0, 0.0, 6.0])
    metrics = scorer.metrics(total, per_fn)
    assert metrics["reward"] == pytest.approx(8 / 3) and metrics["rewards/a/mean"] == 2.0
    assert "rewards/b/mean" not in metrics  # applied to no completion
    assert RewardScorer([("a", _const([]))]).weights == (1.0,)
    with pytest.raises(ValueError, match="at least one reward"):
        RewardScorer([])
    with pytest.raises(ValueError, match="2 weights for 1 reward"):
        RewardScorer([("a", _const([]))], [1.0, 2.0])


def test_score_all_none_is_zero_with_a_warning(caplog):
    total, _ = score([("a", _const([None, 1.0]))], [1.0], ["p"] * 2, ["x", "y"], {})
    assert total.tolist() == [0.0, 1.0]
    assert "got None from every reward function" in caplog.text


def test_score_passes_columns():
    seen = {}

    def reads(prompts, completions, answer, completion_ids, **kw):
        seen.update(answer=answer, ids=completion_ids)
        return [0.0] * len(completions)

    score([("reads", reads)], [1.0], ["p", "q"], ["x", "y"], {"answer": ["1", "2"], "completion_ids": [[3], [4]]})
    assert seen == {"answer": ["1", "2"], "ids": [[3], [4]]}


def _raises(prompts, completions, **kw):
    raise KeyError("answer")


@pytest.mark.parametrize("fn,message", [
    (_raises, "reward function 'bad' raised KeyError"),
    (_const([1.0]), "reward function 'bad' returned 1 values for 2 completions"),
    (_const(3.0), "must return a list of 2 floats"),
    (_const([1.0, float("nan")]), "returned nan for completion 1"),
    (_const([1.0, "1"]), "returned '1' for completion 1"),
    (_const([True, 1.0]), "returned True for completion 0"),
])
def test_score_errors_name_the_function(fn, message):
    with pytest.raises(RewardError, match=message):
        score([("bad", fn)], [1.0], ["p", "q"], ["x", "y"], {})
