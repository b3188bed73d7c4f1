"""`tunix-rt eval`: perplexity, multiple choice and generative accuracy against sums computed here from the
model's own logits; the formats it compares; its files and its refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.models.hf_tiny import make_tiny_model_dir
from tests.train.test_train_cli import cli
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.evaluation import tasks
from tunix_rt.evaluation.formats import models_in_formats, parse_formats, weight_bytes
from tunix_rt.train.data import DataError

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile-bound (conftest.fast_compiles says when)

pytest.importorskip("transformers", reason="the tiny HF model is made with transformers (the parity extra)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model_dir(path, "qwen3")
    return path, load_model(path)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _next_logprobs(model, ids):
    tokens = np.asarray([ids], np.int32)
    logits = np.asarray(model(tokens, np.arange(len(ids))[None]), np.float64)[0]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return logp[np.arange(len(ids) - 1), ids[1:]]


def test_perplexity_counts_each_token_once_and_chats_only_the_assistant(tiny, tmp_path):
    _, loaded = tiny
    tok = loaded.tokenizer
    rows = [{"text": "the theme of the thesis"},
            {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "the end"}]}]
    windows = tasks.prepare_perplexity(_write(tmp_path / "p.jsonl", rows), tok, max_length=512)
    assert len(windows.sequences) == 2
    result = tasks.score_perplexity(loaded.model, windows, batch_size=4)
    nll, count = 0.0, 0
    for ids, counted in zip(windows.sequences, windows.counted):
        nll -= _next_logprobs(loaded.model, ids)[counted].sum()
        count += counted.sum()
    assert result["tokens"] == count < sum(len(s) - 1 for s in windows.sequences)  # the user turn is not counted
    assert result["perplexity"] == pytest.approx(np.exp(nll / count), rel=1e-4)
    # a long row in windows of 8: every token after the first is predicted once
    long_row = {"text": " ".join(["the theme"] * 20)}
    split = tasks.prepare_perplexity(_write(tmp_path / "l.jsonl", [long_row]), tok, max_length=8)
    whole = tasks.prepare_perplexity(_write(tmp_path / "w.jsonl", [long_row]), tok, max_length=4096)
    assert len(split.sequences) > 1 and max(map(len, split.sequences)) <= 8
    assert sum(c.sum() for c in split.counted) == sum(c.sum() for c in whole.counted)
    assert [t for s in split.sequences for t in s[1:]] == whole.sequences[0][1:]


def test_choice_matches_summed_continuation_logprobs(tiny, tmp_path):
    _, loaded = tiny
    rows = [{"question": "the", "choices": ["theme", "the", "he"], "label": 1},
            {"question": "thesis?", "choices": ["no", "yes"], "answer": 0}]
    prepared = tasks.prepare_choice(_write(tmp_path / "c.jsonl", rows), loaded.tokenizer)
    result = tasks.score_choice(loaded.model, prepared, batch_size=2)
    sums = [_next_logprobs(loaded.model, ids)[start - 1:].sum()
            for ids, start in zip(prepared.sequences, prepared.continuation_starts)]
    picks = [int(np.argmax(sums[:3])), int(np.argmax(sums[3:]))]
    assert result["acc"] == np.mean([picks[0] == 1, picks[1] == 0])
    lengths = [len(c) for r in rows for c in r["choices"]]  # lm-eval's acc_norm: the choice's own length
    normed = [s / n for s, n in zip(sums, lengths)]
    assert result["acc_norm"] == np.mean([int(np.argmax(normed[:3])) == 1, int(np.argmax(normed[3:])) == 0])
    assert result["rows"] == 2


@pytest.mark.parametrize("row, match", [
    ({"question": "q", "choices": ["a"], "label": 0}, "at least two"),
    ({"question": "q", "choices": ["a", "b"], "label": 2}, "index of the right choice"),
    ({"question": "q", "choices": ["a", "b"], "label": True}, "index of the right choice"),
    ({"choices": ["a", "b"], "label": 0}, "question"),
])
def test_bad_choice_rows_are_refused_by_line(tiny, tmp_path, row, match):
    _, loaded = tiny
    with pytest.raises(DataError, match=f"c.jsonl:1: .*{match}"):
        tasks.prepare_choice(_write(tmp_path / "c.jsonl", [row]), loaded.tokenizer)


def test_accuracy_generates_with_the_engine_and_marks_with_the_reward(tiny, tmp_path):
    """The reward gets the engine's greedy completions and the rows' columns; accuracy is the mean of its marks."""
    from tunix_rt.engine.engine import Engine
    from tunix_rt.engine.params import SamplingParams

    _, loaded = tiny
    seen = {}

    def reward(prompts, completions, answer, completion_ids, **columns):
        seen.update(prompts=prompts, completions=completions, answer=answer)
        return [float(c.startswith(a)) for c, a in zip(completions, answer)]

    engine = Engine(loaded.model, loaded.tokenizer, max_model_len=64, max_num_seqs=2)
    prompts = ["the theme", "thesis"]
    expected = [o.text for o in engine.generate([loaded.tokenizer.encode(p) for p in prompts],
                                                SamplingParams(temperature=0, max_tokens=4))]
    rows = [{"prompt": prompts[0], "answer": expected[0][:2]}, {"prompt": prompts[1], "answer": "never" * 9}]
    prepared = tasks.prepare_accuracy(_write(tmp_path / "a.jsonl", rows), loaded.tokenizer, max_prompt_length=64)
    result = tasks.score_accuracy(loaded.model, loaded.tokenizer, prepared, reward=("mine", reward), max_tokens=4)
    assert seen == {"prompts": prompts, "completions": expected, "answer": [r["answer"] for r in rows]}
    assert result["rows"] == 2 and result["accuracy"] == 0.5
    with pytest.raises(DataError, match="need their reference answer in one of answer"):
        tasks.prepare_accuracy(_write(tmp_path / "b.jsonl", [{"prompt": "x"}]), loaded.tokenizer, max_prompt_length=8,
                               reference_columns=("answer",))
    with pytest.raises(DataError, match="columns"):  # rows must share their columns, as RL's prompts do
        tasks.prepare_accuracy(_write(tmp_path / "c.jsonl", [{"prompt": "x", "answer": "1"},
                                                             {"prompt": "y", "solution": "2"}]),
                               loaded.tokenizer, max_prompt_length=8)
    from tunix_rt.train.rewards import RewardError

    with pytest.raises(RewardError, match="'bad' returned"):
        tasks.score_accuracy(loaded.model, loaded.tokenizer, prepared, reward=("bad", lambda *a, **k: [1.0]),
                             max_tokens=2)


def test_formats_are_the_gguf_round_trips(tiny):
    _, loaded = tiny
    assert parse_formats("q8_0,source,q8_0") == ["q8_0", "source"]
    with pytest.raises(ValueError, match="--formats"):
        parse_formats("q5_k")
    sizes = {fmt: weight_bytes(model) for fmt, model in models_in_formats(loaded, ["f32", "q8_0", "q4_0"])}
    assert sizes["q4_0"] < sizes["q8_0"] < sizes["f32"]


def test_cli_prints_the_table_and_writes_json_and_png(tiny, tmp_path, capsys):
    path, _ = tiny
    data = _write(tmp_path / "c.jsonl", [{"question": "the", "choices": ["theme", "he"], "label": 0}] * 3)
    out = tmp_path / "out"
    assert cli("eval", "--model", path, "--data", data, "--task", "choice", "--formats", "source,q8_0",
               "--output", out) == 0
    printed = capsys.readouterr().out
    assert "acc_norm" in printed and "q8_0" in printed
    written = json.loads((out / "eval.json").read_text())
    assert [r["format"] for r in written["results"]] == ["source", "q8_0"] and written["task"] == "choice"
    assert (out / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli("eval", "--model", path, "--data", data, "--task", "choice", "--output", out) == 2  # not empty
    assert cli("eval", "--model", path, "--data", data, "--output", tmp_path, "--overwrite") == 2  # holds the data
    assert cli("eval", "--model", path, "--data", data, "--formats", "int3") == 2
    assert cli("eval", "--model", path, "--data", data, "--batch-size", "0") == 2
    assert "--batch-size must be at least 1" in capsys.readouterr().err


def answered(prompts, completions, **columns):
    """A reward for the CLI test (`--reward tests.evaluation.test_eval:answered`): 1 for any completion."""
    return [1.0 for _ in completions]


def test_cli_accuracy_task(tiny, tmp_path, capsys):
    path, _ = tiny
    data = _write(tmp_path / "a.jsonl", [{"prompt": "the theme", "answer": "1"}, {"prompt": "thesis", "answer": "2"}])
    assert cli("eval", "--model", path, "--data", data, "--task", "accuracy", "--max-tokens", "4",
               "--reward", "tests.evaluation.test_eval:answered") == 0
    assert "accuracy" in capsys.readouterr().out
    bare = _write(tmp_path / "b.jsonl", [{"prompt": "the theme"}])
    assert cli("eval", "--model", path, "--data", bare, "--task", "accuracy", "--max-tokens", "4") == 2  # no answer
    assert "reference answer" in capsys.readouterr().err
    assert cli("eval", "--model", path, "--data", data, "--task", "accuracy", "--max-tokens", "100000") == 2
    assert "leaves no room" in capsys.readouterr().err
