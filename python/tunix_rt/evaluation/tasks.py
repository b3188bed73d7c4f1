"""The three eval tasks, each in two halves: `prepare` reads and tokenizes the rows once (they are the same
for every format), `score` runs one model over them and returns its metrics.

- perplexity: text, prompt/completion or chat rows (tokenized as SFT does: chats count the assistant's tokens,
  prompt/completion rows the completion's); a row longer than `max_length` is scored in consecutive windows,
  each starting from the last token of the one before, so every counted token is predicted once.
- choice: {"question", "choices", "label" (or "answer")}, scored as lm-evaluation-harness scores a
  multiple-choice task: context "Question: {question}\\nAnswer:", each choice " {choice}" as a continuation
  (tokens of context + continuation past those of the context, no special tokens added), acc by the summed
  log-likelihood and acc_norm by it over the choice's length in characters.
- accuracy: {"prompt", "answer"} rows (a string or a chat prompt) answered greedily by the engine and marked by
  a reward function (the math `accuracy` reward RL uses by default).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from tunix_rt.checkpoints.tokenizer import Tokenizer
from tunix_rt.models.decoder import Decoder
from tunix_rt.models.scoring import batch_token_logprobs
from tunix_rt.train.data import DataError, PromptExample, load_prompts, read_jsonl, tokenize_sft
from tunix_rt.train.rewards import score as score_rewards

TASKS = ("perplexity", "choice", "accuracy")
CHOICE_CONTEXT = "Question: {question}\nAnswer:"


class Windows(NamedTuple):
    """Token sequences to score and, per sequence, which of its predictions (positions 1..n-1) count."""

    sequences: list[list[int]]
    counted: list[np.ndarray]


class Choices(NamedTuple):
    sequences: list[list[int]]  # one per (row, choice), row-major
    continuation_starts: list[int]  # index of each sequence's first continuation token
    choice_chars: list[int]
    choices_per_row: list[int]
    labels: list[int]


def prepare_perplexity(path, tokenizer: Tokenizer, *, max_length: int) -> Windows:
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 to predict a token, got {max_length}")
    sequences, counted = [], []
    for line, row in read_jsonl(path):
        example = tokenize_sft(row, tokenizer, max_length=1 << 62, where=f"{path}:{line}")
        ids, mask = example.input_ids.tolist(), example.loss_mask
        for start in range(0, max(len(ids) - 1, 1), max_length - 1):
            window = ids[start:start + max_length]
            if len(window) < 2:
                continue
            sequences.append(window)
            counted.append(mask[start + 1:start + len(window)].copy())
    if not any(c.any() for c in counted):
        raise DataError(f"{path}: no row has a token to score (a chat needs an assistant turn)")
    return Windows(sequences, counted)


def score_perplexity(model: Decoder, windows: Windows, *, batch_size: int, progress=None) -> dict:
    start = time.perf_counter()
    logprobs = batch_token_logprobs(model, windows.sequences, batch_size=batch_size, progress=progress)
    seconds = time.perf_counter() - start
    nll = -sum(float(lp[c].astype(np.float64).sum()) for lp, c in zip(logprobs, windows.counted))
    tokens = int(sum(c.sum() for c in windows.counted))
    return {"perplexity": float(np.exp(nll / tokens)), "nll": nll / tokens, "tokens": tokens,
            "tokens_per_s": sum(map(len, windows.sequences)) / seconds}


def _choice_row(row: dict, where: str) -> tuple[str, list[str], int]:
    question, choices = row.get("question"), row.get("choices")
    label = row.get("label", row.get("answer"))
    if not isinstance(question, str):
        raise DataError(f'{where}: a choice row needs a string "question"')
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise DataError(f'{where}: "choices" must be a list of at least two non-empty strings')
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        raise DataError(f'{where}: "label" (or "answer") must be the index of the right choice, 0 to '
                        f"{len(choices) - 1}, got {label!r}")
    return question, choices, label


def prepare_choice(path, tokenizer: Tokenizer) -> Choices:
    out = Choices([], [], [], [], [])
    for line, row in read_jsonl(path):
        question, choices, label = _choice_row(row, f"{path}:{line}")
        context = CHOICE_CONTEXT.format(question=question)
        context_ids = tokenizer.encode(context, add_special_tokens=False)  # lm-eval's requests carry no BOS
        for choice in choices:
            continuation = " " + choice
            whole = tokenizer.encode(context + continuation, add_special_tokens=False)
            out.sequences.append(whole)
            out.continuation_starts.append(min(len(context_ids), len(whole) - 1))
            out.choice_chars.append(len(choice))  # lm-eval's acc_norm divides by the choice's own length
        out.choices_per_row.append(len(choices))
        out.labels.append(label)
    return out


def score_choice(model: Decoder, choices: Choices, *, batch_size: int, progress=None) -> dict:
    start = time.perf_counter()
    logprobs = batch_token_logprobs(model, choices.sequences, batch_size=batch_size, progress=progress)
    seconds = time.perf_counter() - start
    sums = np.asarray([float(lp[s - 1:].astype(np.float64).sum())
                       for lp, s in zip(logprobs, choices.continuation_starts)])
    chars = np.asarray(choices.choice_chars, np.float64)
    right = right_norm = 0
    at = 0
    for count, label in zip(choices.choices_per_row, choices.labels):
        right += int(np.argmax(sums[at:at + count]) == label)
        right_norm += int(np.argmax(sums[at:at + count] / chars[at:at + count]) == label)
        at += count
    rows = len(choices.labels)
    return {"acc": right / rows, "acc_norm": right_norm / rows, "rows": rows,
            "tokens_per_s": sum(map(len, choices.sequences)) / seconds}


def prepare_accuracy(path, tokenizer: Tokenizer, *, max_prompt_length: int,
                     reference_columns: tuple[str, ...] = ()) -> list[PromptExample]:
    """The rows as RL reads its prompts (every row with the same columns); with `reference_columns` (what the
    reward reads: the math accuracy reward's answer, solution or ground_truth), one of them must be there."""
    rows = load_prompts(path, tokenizer, max_prompt_length=max_prompt_length)
    if reference_columns and not any(k in rows[0].columns for k in reference_columns):
        raise DataError(f"{path}: the rows need their reference answer in one of {', '.join(reference_columns)}")
    return rows


def score_accuracy(model: Decoder, tokenizer: Tokenizer, rows: list[PromptExample], *, reward, max_tokens: int,
                   progress=None) -> dict:
    """Greedy answers from the engine, marked by `reward` (name, function) as RL scores a rollout: the mean over
    the rows it marks (a None is a row it cannot judge)."""
    from tunix_rt.engine.engine import Engine
    from tunix_rt.engine.params import SamplingParams

    longest = min(max(len(r.prompt_ids) for r in rows) + max_tokens, model.config.max_position_embeddings)
    engine = Engine(model, tokenizer, max_model_len=longest, max_num_seqs=min(len(rows), 32))
    start = time.perf_counter()
    outputs = engine.generate([r.prompt_ids.tolist() for r in rows],
                              SamplingParams(temperature=0, max_tokens=max_tokens))
    seconds = time.perf_counter() - start
    if progress is not None:
        progress(sum(len(o.token_ids) for o in outputs))
    completions = [o.text if isinstance(r.prompt, str) else [{"role": "assistant", "content": o.text}]
                   for r, o in zip(rows, outputs)]
    columns = {k: [r.columns[k] for r in rows] for k in rows[0].columns}
    columns["completion_ids"] = [list(o.token_ids) for o in outputs]
    _, per_fn = score_rewards([reward], [1.0], [r.prompt for r in rows], completions, columns)
    marks = per_fn[0][~np.isnan(per_fn[0])]
    if not marks.size:
        raise DataError("the reward marked no row (it returned None for every one)")
    return {"accuracy": float(marks.mean()), "rows": int(marks.size),
            "tokens_per_s": sum(len(o.token_ids) for o in outputs) / seconds}
