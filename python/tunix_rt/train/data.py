"""Training data for SFT, DPO and RL prompts: JSONL rows in TRL's formats -> token ids (with loss masks) -> batches.

Numpy only. A batch is as long as its longest row needs, rounded up to a bucket of `bucket_length` (16s up to
64, then powers of two and the points halfway between), so the trainer compiles one program per bucket, never one per batch,
and short chats are not padded to max_length (a reward model's pairs, packed end to end, take the finer
`packed_length`). The trained targets are gathered into a window of their own
(`head_window`), so the output head runs on them only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from tunix_rt.checkpoints.tokenizer import Tokenizer
from tunix_rt.train.image_data import ImageDataError, VisionRows, check_placeholders
from tunix_rt.train.image_data import cut as cut_images
from tunix_rt.train.image_data import prepare as prepare_images

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """A dataset that cannot be trained on; the message starts with FILE:LINE of the row at fault."""


class SFTExample(NamedTuple):
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # bool, per input token: whether the model should learn to produce it
    pixel_values: np.ndarray | None = None  # (runs, C, H, W): the images of its runs of image placeholders, in order


class PreferenceExample(NamedTuple):
    prompt_ids: np.ndarray  # int32
    chosen_ids: np.ndarray  # int32, the tokens after the prompt
    rejected_ids: np.ndarray  # int32
    pixel_values: np.ndarray | None = None  # the prompt's images (SFTExample's)
    margin: float = 0.0  # TRL's optional "margin" column: how much more the chosen is preferred (reward models)


@dataclasses.dataclass
class PackedRow:
    """Examples sharing one row of a batch, in dataset order; each becomes its own segment."""

    segments: list[SFTExample]


# --- reading --------------------------------------------------------------------------------------------------


def read_jsonl(path) -> list[tuple[int, dict]]:
    """(1-based line number, row) for each non-blank line, so every later error can point at its line."""
    rows = []
    try:
        # Iterating the file splits on newlines only; str.splitlines would also split inside strings at U+2028.
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{number}: invalid JSON: {e.msg} (column {e.colno})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{number}: a row must be a JSON object, got {_kind(row)}")
                rows.append((number, row))
    except OSError as e:
        raise DataError(f"{path}: cannot read the dataset: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: the dataset is not UTF-8 text: {e}") from e
    if not rows:
        raise DataError(f"{path}: the dataset has no rows")
    return rows


# --- SFT ------------------------------------------------------------------------------------------------------


def tokenize_sft(
    row: dict,
    tokenizer: Tokenizer,
    *,
    max_length: int,
    where: str,
    assistant_only_loss: bool = True,
    completion_only_loss: bool = True,
    vision: VisionRows | None = None,
) -> SFTExample:
    """Token ids and loss mask of one SFT row: {"messages"}, {"prompt", "completion"} (strings or messages) or
    {"text"}. assistant_only_loss applies to conversations, completion_only_loss to prompt/completion rows; both
    together keep only the completion's assistant turns, as in TRL. Truncated to the first max_length tokens.
    A "messages" row may carry images (TRL's vision format, train/image_data.py; `vision`: the model's)."""
    if "messages" in row:
        try:
            prepared = prepare_images(row, vision)
        except ImageDataError as e:
            raise DataError(f"{where}: {e}") from None
        messages = _messages(prepared.messages, "messages", where)
        ids, mask = _conversation(tokenizer, messages, None, assistant_only_loss, where, prepared.expand)
        if vision is not None:
            try:
                check_placeholders(ids, prepared.pixel_values, vision)
            except ImageDataError as e:
                raise DataError(f"{where}: {e}") from None
        if prepared.pixel_values is not None:
            ids, mask, pixels = cut_images(ids, mask, prepared.pixel_values, vision.image_token_id, max_length)
            return SFTExample(np.asarray(ids, np.int32), np.asarray(mask, bool), pixels)
    elif "images" in row:
        raise DataError(f'{where}: images go with a "messages" row (TRL\'s vision format)')
    elif "prompt" in row or "completion" in row:
        prompt, completion = _field(row, "prompt", where), _field(row, "completion", where)
        if isinstance(prompt, str) and isinstance(completion, str):
            prompt_ids = tokenizer.encode(prompt)
            ids = prompt_ids + _with_eos(tokenizer.encode(completion, add_special_tokens=False), tokenizer)
            mask = np.arange(len(ids)) >= (len(prompt_ids) if completion_only_loss else 0)
        elif isinstance(prompt, list) and isinstance(completion, list):
            prompt = _messages(prompt, "prompt", where)
            messages = prompt + _messages(completion, "completion", where)
            completion_from = len(prompt) if completion_only_loss else None
            ids, mask = _conversation(tokenizer, messages, completion_from, assistant_only_loss, where)
        else:
            raise DataError(
                f'{where}: fields "prompt" and "completion" must both be strings or both be lists of messages, '
                f"got {_kind(prompt)} and {_kind(completion)}"
            )
    elif "text" in row:
        text = row["text"]
        if not isinstance(text, str):
            raise DataError(f'{where}: field "text" must be a string, got {_kind(text)}')
        ids = _with_eos(tokenizer.encode(text), tokenizer)
        mask = np.ones(len(ids), bool)
    else:
        raise DataError(
            f'{where}: an SFT row needs field "messages", fields "prompt" and "completion", or field "text"; '
            f"it has {sorted(row) or 'no fields'}"
        )
    return SFTExample(np.asarray(ids[:max_length], np.int32), np.asarray(mask[:max_length], bool))


def load_sft(
    path, tokenizer: Tokenizer, *, max_length: int, assistant_only_loss: bool = True, completion_only_loss: bool = True,
    vision: VisionRows | None = None,
) -> list[SFTExample]:
    """Every row of a JSONL file tokenized; rows left with no trained token (say, the assistant turn truncated
    away) are dropped with a warning, and only a dataset with none left is an error."""
    numbered = [
        (
            line,
            tokenize_sft(
                row,
                tokenizer,
                max_length=max_length,
                where=f"{path}:{line}",
                assistant_only_loss=assistant_only_loss,
                completion_only_loss=completion_only_loss,
                vision=vision,
            ),
        )
        for line, row in read_jsonl(path)
    ]
    return _keep_trainable(path, numbered, lambda example: example.loss_mask.any(), max_length)


def _conversation(
    tokenizer: Tokenizer, messages: list[dict], completion_from: int | None, assistant_only: bool, where: str,
    expand=None,
) -> tuple[list[int], np.ndarray]:
    """Render and tokenize a conversation once; train only on tokens after the generation prompt that follows
    messages[:completion_from] (unless None) and, with `assistant_only`, inside an assistant turn (the turn's
    end-of-turn text included). A token counts as where it starts. `expand` puts images in every render."""
    text = _render(tokenizer, messages, False, where, expand)
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    starts = np.array([start for start, _ in encoding.offsets], dtype=np.int64)
    mask = np.ones(len(starts), bool)
    if completion_from is not None:
        prompt_end = _prefix_length(
            _render(tokenizer, messages[:completion_from], True, where, expand),
            text,
            f"{where}: completion-only loss needs the chat template's render of the prompt (with the generation "
            "prompt) to be a prefix of its render of prompt + completion; it is not, so set "
            "completion_only_loss=False to train on every token",
        )
        mask &= starts >= prompt_end
    if assistant_only:
        in_turn = np.zeros_like(mask)
        for begin, end in _assistant_spans(tokenizer, messages, text, where, expand):
            in_turn |= (starts >= begin) & (starts < end)
        mask &= in_turn
    return encoding.ids, mask


def _assistant_spans(tokenizer: Tokenizer, messages: list[dict], text: str, where: str,
                     expand=None) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in `text`, found by rendering each turn's prefix -- so any template
    works that renders a conversation's first turns as a prefix of the whole, no `{% generation %}` tags needed."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        problem = (
            f"{where}: assistant-only loss needs a chat template whose render of a conversation's first turns is a "
            f"prefix of its render of the whole; this one renders messages[:{i}] or messages[:{i + 1}] differently, "
            "so set assistant_only_loss=False to train on every token"
        )
        before = _prefix_length(_render(tokenizer, messages[:i], True, where, expand), text, problem)
        spans.append((before, _prefix_length(_render(tokenizer, messages[: i + 1], False, where, expand), text,
                                             problem)))
    return spans


# --- DPO ------------------------------------------------------------------------------------------------------


def tokenize_preference(
    row: dict, tokenizer: Tokenizer, *, max_length: int, max_prompt_length: int | None = None, where: str,
    vision: VisionRows | None = None,
) -> PreferenceExample:
    """Prompt, chosen and rejected ids of one DPO row: strings, lists of messages, or (TRL's implicit prompt)
    "chosen" and "rejected" alone as whole conversations whose shared first messages are the prompt. A row of
    messages may carry images in its prompt (TRL's vision format: image parts and an "images" column).

    Truncated as TRL does: the prompt keeps its last max_prompt_length tokens, then prompt + completion its first
    max_length; a prompt with images must fit whole.
    """
    chosen, rejected = _field(row, "chosen", where), _field(row, "rejected", where)
    expand, pixels = None, None
    if row.get("images") is not None and "prompt" not in row:
        raise DataError(f'{where}: a row with images needs a "prompt" field (the messages the images go in)')
    if isinstance(chosen, list) and isinstance(rejected, list):
        try:
            chosen = prepare_images({"messages": chosen}, None).messages
            rejected = prepare_images({"messages": rejected}, None).messages
            if isinstance(row.get("prompt"), list) or row.get("images") is not None:
                prepared = prepare_images({"messages": row.get("prompt", []), "images": row.get("images")}, vision)
                row = {**row, "prompt": prepared.messages} if "prompt" in row else row
                expand, pixels = prepared.expand, prepared.pixel_values
        except ImageDataError as e:
            raise DataError(f"{where}: {e}") from None
    elif "images" in row:
        raise DataError(f'{where}: images go with rows of messages (TRL\'s vision format)')
    if "prompt" not in row and isinstance(chosen, list) and isinstance(rejected, list):
        chosen, rejected = _messages(chosen, "chosen", where), _messages(rejected, "rejected", where)
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == 0:
            raise DataError(
                f'{where}: without a "prompt" field, "chosen" and "rejected" must start with the same messages'
            )
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        for name, completion in (("chosen", chosen), ("rejected", rejected)):
            if not completion:
                raise DataError(f'{where}: field "{name}" has no messages after the prompt it shares with the other')
    else:
        prompt = _field(row, "prompt", where)

    prompt_ids, (chosen_ids, rejected_ids) = _encode_completions(
        tokenizer, prompt, {"chosen": chosen, "rejected": rejected}, where, expand)

    if vision is not None:
        try:
            check_placeholders(prompt_ids, pixels, vision)
            for completion_ids in (chosen_ids, rejected_ids):
                check_placeholders(completion_ids, None, vision)
        except ImageDataError as e:
            raise DataError(f"{where}: {e}") from None
    limit = min(max_length, max_prompt_length or max_length)
    if pixels is not None and len(prompt_ids) > limit:
        raise DataError(f"{where}: the prompt with its images is {len(prompt_ids)} tokens, more than "
                        f"{'max_prompt_length' if limit < max_length else 'max_length'} ({limit}); an image is never cut")
    prompt_ids = _truncate_prompt(prompt_ids, max_length, max_prompt_length)
    room = max_length - len(prompt_ids)
    margin = row.get("margin", 0.0)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not np.isfinite(margin):
        raise DataError(f'{where}: field "margin" must be a finite number, got {margin!r}')
    return PreferenceExample(
        *(np.asarray(ids, np.int32) for ids in (prompt_ids, chosen_ids[:room], rejected_ids[:room])), pixels,
        float(margin)
    )


def load_preferences(
    path, tokenizer: Tokenizer, *, max_length: int, max_prompt_length: int | None = None,
    vision: VisionRows | None = None,
) -> list[PreferenceExample]:
    """Every row of a JSONL file tokenized; pairs truncated to an empty chosen or rejected side are dropped with a
    warning, and only a dataset with none left is an error."""
    numbered = [
        (
            line,
            tokenize_preference(
                row, tokenizer, max_length=max_length, max_prompt_length=max_prompt_length, where=f"{path}:{line}",
                vision=vision,
            ),
        )
        for line, row in read_jsonl(path)
    ]
    return _keep_trainable(
        path, numbered, lambda example: min(len(example.chosen_ids), len(example.rejected_ids)) > 0, max_length
    )


class UnpairedExample(NamedTuple):
    """A KTO row: a prompt, one completion and whether it is desirable (TRL's unpaired preference format)."""

    prompt_ids: np.ndarray  # int32
    completion_ids: np.ndarray  # int32
    desirable: bool


def tokenize_unpaired(row: dict, tokenizer: Tokenizer, *, max_length: int, max_prompt_length: int | None = None,
                      where: str) -> UnpairedExample:
    """{"prompt", "completion", "label"}: strings or lists of messages, label true (desirable) or false; truncated
    as preference rows are."""
    label = _field(row, "label", where)
    if not isinstance(label, bool):
        raise DataError(f'{where}: field "label" must be true or false, got {label!r}')
    prompt_ids, (completion_ids,) = _encode_completions(
        tokenizer, _field(row, "prompt", where), {"completion": _field(row, "completion", where)}, where)
    prompt_ids = _truncate_prompt(prompt_ids, max_length, max_prompt_length)
    return UnpairedExample(np.asarray(prompt_ids, np.int32),
                           np.asarray(completion_ids[:max_length - len(prompt_ids)], np.int32), label)


def load_unpaired(path, tokenizer: Tokenizer, *, max_length: int,
                  max_prompt_length: int | None = None) -> list[UnpairedExample]:
    """Every row of a JSONL file tokenized; rows truncated to an empty completion are dropped with a warning."""
    numbered = [(line, tokenize_unpaired(row, tokenizer, max_length=max_length, max_prompt_length=max_prompt_length,
                                         where=f"{path}:{line}"))
                for line, row in read_jsonl(path)]
    return _keep_trainable(path, numbered, lambda example: len(example.completion_ids) > 0, max_length)


def _encode_completions(tokenizer: Tokenizer, prompt, completions: dict, where: str,
                        expand=None) -> tuple[list[int], list[list[int]]]:
    """The prompt's ids and each completion's (named by its field): all strings (the prompt with the tokenizer's
    special tokens, each completion closed by EOS) or all lists of messages (through the chat template, each
    completion tokenized apart from the prompt as TRL does)."""
    values = (prompt, *completions.values())
    if all(isinstance(value, str) for value in values):
        return tokenizer.encode(prompt), [_with_eos(tokenizer.encode(completion, add_special_tokens=False), tokenizer)
                                          for completion in completions.values()]
    if all(isinstance(value, list) for value in values):
        prompt = _messages(prompt, "prompt", where)
        prompt_text = _render(tokenizer, prompt, True, where, expand)
        return tokenizer.encode(prompt_text, add_special_tokens=False), [
            _completion_ids(tokenizer, prompt, prompt_text, completion, name, where, expand)
            for name, completion in completions.items()]
    names = ", ".join(f'"{name}"' for name in ("prompt", *completions))
    names, kinds = (" and ".join(text.rsplit(", ", 1)) for text in (names, ", ".join(map(_kind, values))))
    every = "both" if len(values) == 2 else "all"
    raise DataError(f"{where}: fields {names} must {every} be strings or {every} be lists of messages, got {kinds}")


def _truncate_prompt(prompt_ids: list[int], max_length: int, max_prompt_length: int | None) -> list[int]:
    """TRL's truncation of a prompt: its last max_prompt_length tokens, then its first max_length (the completions
    keep the room left)."""
    if max_prompt_length is not None:
        prompt_ids = prompt_ids[max(0, len(prompt_ids) - max_prompt_length):]
    return prompt_ids[:max_length]


def _completion_ids(
    tokenizer: Tokenizer, prompt: list[dict], prompt_text: str, completion, name: str, where: str, expand=None
) -> list[int]:
    """The tokens of what the template writes for `completion` after the prompt and its generation prompt,
    tokenized apart from the prompt as TRL does."""
    full = _render(tokenizer, prompt + _messages(completion, name, where), False, where, expand)
    start = _prefix_length(
        prompt_text,
        full,
        f"{where}: the chat template's render of the prompt (with the generation prompt) is not a prefix of its "
        f'render of prompt + {name}, so the "{name}" tokens cannot be told apart from the prompt',
    )
    return tokenizer.encode(full[start:], add_special_tokens=False)


# --- RL prompts -----------------------------------------------------------------------------------------------


class PromptExample(NamedTuple):
    """One GRPO/PPO row: the prompt's token ids, the prompt as the reward functions see it, and every other
    column of the row (what the rewards read, e.g. "answer")."""

    prompt_ids: np.ndarray  # int32
    prompt: str | list  # the row's "prompt" as given: a string, or a list of messages (conversational)
    columns: dict


def tokenize_prompt(row: dict, tokenizer: Tokenizer, *, max_prompt_length: int, where: str) -> PromptExample:
    """A string prompt is encoded as is; a list of messages goes through the chat template with the generation
    prompt. Too long a prompt keeps its last max_prompt_length tokens (TRL's left truncation)."""
    prompt = _field(row, "prompt", where)
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f'{where}: field "prompt" is an empty string')
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list):
        ids = tokenizer.encode(_render(tokenizer, _messages(prompt, "prompt", where), True, where),
                               add_special_tokens=False)
    else:
        raise DataError(f'{where}: field "prompt" must be a string or a list of messages, got {_kind(prompt)}')
    ids = ids[max(0, len(ids) - max_prompt_length):]
    if not ids:
        raise DataError(f"{where}: the prompt has no tokens")
    return PromptExample(np.asarray(ids, np.int32), prompt, {k: v for k, v in row.items() if k != "prompt"})


def load_prompts(path, tokenizer: Tokenizer, *, max_prompt_length: int, tokenize=tokenize_prompt) -> list[PromptExample]:
    """Every row of a JSONL file as a PromptExample (made by `tokenize`, tokenize_prompt's signature); the rows
    must share one set of columns (the reward functions get each column as a list aligned with the completions)."""
    examples = []
    keys = None
    for line, row in read_jsonl(path):
        where = f"{path}:{line}"
        example = tokenize(row, tokenizer, max_prompt_length=max_prompt_length, where=where)
        if keys is None:
            keys = set(example.columns)
        elif set(example.columns) != keys:
            raise DataError(f"{where}: the row's columns {sorted(example.columns)} differ from the first row's "
                            f"{sorted(keys)}; every row must have the same fields")
        examples.append(example)
    return examples


# --- batching -------------------------------------------------------------------------------------------------


def bucket_length(n: int, cap: int | None = None) -> int:
    """The padded length of a batch whose longest row is n: the next multiple of 16 up to 64, then the next of
    64, 96, 128, 192, 256, 384, 512, 768, ... (powers of two and the halfway points 1.5x above them); at most
    `cap` (max_length) when n fits in it. Padding stays under a third, and a dataset meets few buckets (10 up to
    512), each one compile of the train step."""
    n = max(int(n), 1)
    length = -(-n // 16) * 16
    if length > 64:
        length = 64
        while length < n:
            length = length + length // 2 if length & (length - 1) == 0 else length // 3 * 4
    return min(length, cap) if cap is not None and n <= cap else length


def packed_length(n: int) -> int:
    """The padded length of a row packing several examples end to end, n tokens in all: the next multiple of 16
    up to 128, then of an eighth of n's octave (64 from 513 to 1024). A packed row's total varies little from
    batch to batch, so the finer steps cost few compiles and keep the padding under an eighth."""
    n = max(int(n), 1)
    step = 16 if n <= 128 else 1 << ((n - 1).bit_length() - 4)
    return -(-n // step) * step


def harmonized_lengths(needs: Sequence[tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """For each row length among `needs` (tuples of bucketed axis lengths, the row length first), the largest
    of every other axis among the needs with that row length: batches of one row length then share one shape,
    so a run compiles one program per row-length bucket, not one per (row length, head window) pair."""
    planned: dict[int, tuple[int, ...]] = {}
    for need in needs:
        planned[need[0]] = tuple(int(v) for v in np.maximum(planned.get(need[0], need), need))
    return planned


def row_length(row: PackedRow | SFTExample) -> int:
    return sum(len(e.input_ids) for e in row.segments) if isinstance(row, PackedRow) else len(row.input_ids)


def head_window(loss_mask: np.ndarray, targets: np.ndarray, size: int) -> dict[str, np.ndarray]:
    """The trained positions of a (B, T) batch gathered into `size` slots, so the output head and the
    log-softmax run on them only: head_index (flat index into B * T of the position whose output predicts the
    target), head_targets, head_mask (the position's loss weight, 0 on unused slots) and head_row (its row)."""
    flat = np.flatnonzero(loss_mask.reshape(-1))
    if len(flat) > size:
        raise ValueError(f"the batch trains {len(flat)} tokens, more than its head window of {size}")
    window = {"head_index": np.zeros(size, np.int32), "head_targets": np.zeros(size, np.int32),
              "head_mask": np.zeros(size, np.float32), "head_row": np.zeros(size, np.int32)}
    window["head_index"][: len(flat)] = flat
    window["head_targets"][: len(flat)] = targets.reshape(-1)[flat]
    window["head_mask"][: len(flat)] = loss_mask.reshape(-1)[flat]
    window["head_row"][: len(flat)] = flat // loss_mask.shape[1]
    return window


def trained_tokens(rows: Sequence[PackedRow | SFTExample]) -> int:
    """Targets a batch of these rows trains on (an example's first token predicts nothing)."""
    segments = [e for row in rows for e in (row.segments if isinstance(row, PackedRow) else [row])]
    return int(sum(e.loss_mask[1:].sum() for e in segments))


def pack(examples: Sequence[SFTExample], seq_len: int) -> list[PackedRow]:
    """Greedy packing in dataset order: an example joins the current row while it fits, else starts the next one.
    An example longer than seq_len is cut to its first seq_len tokens."""
    rows: list[PackedRow] = []
    used = 0
    for example in examples:
        if example.pixel_values is not None and len(example.input_ids) > seq_len:
            raise ValueError(f"an example with images is longer ({len(example.input_ids)}) than the packed rows "
                             f"({seq_len}): tokenize it with max_length <= {seq_len}")
        example = example._replace(input_ids=example.input_ids[:seq_len], loss_mask=example.loss_mask[:seq_len])
        if not rows or used + len(example.input_ids) > seq_len:
            rows.append(PackedRow([]))
            used = 0
        rows[-1].segments.append(example)
        used += len(example.input_ids)
    return rows


def sft_batch(rows: Sequence[PackedRow | SFTExample], seq_len: int, *, pad_id: int = 0,
              images: tuple[int, tuple[int, ...]] | None = None) -> dict[str, np.ndarray]:
    """One (len(rows), seq_len) batch; a PackedRow's examples become segments 1, 2, ..., a lone SFTExample is a
    row of its own (segment 1), cut to seq_len. With `images` (slots, (C, H, W)) for a dataset with images,
    pixel_values (slots, C, H, W): the examples' images in the order of their placeholders, zeros after.

    tokens: the ids, pad_id after the last segment. positions: the index within the segment (-1 on padding).
    segment_ids: 0 on padding. targets: the next token of the same segment, 0 where there is none.
    loss_mask (float32): 1 where the target is a real next token the example trains on -- so the loss never
    crosses a segment boundary and the model is never asked to predict padding.
    """
    shape = (len(rows), seq_len)
    batch = {
        "tokens": np.full(shape, pad_id, np.int32),
        "positions": np.full(shape, -1, np.int32),
        "segment_ids": np.zeros(shape, np.int32),
        "targets": np.zeros(shape, np.int32),
        "loss_mask": np.zeros(shape, np.float32),
    }
    for r, row in enumerate(rows):
        offset = 0
        for segment_id, example in enumerate(row.segments if isinstance(row, PackedRow) else [row], 1):
            ids = example.input_ids[: seq_len - offset]
            n = len(ids)
            batch["tokens"][r, offset : offset + n] = ids
            batch["positions"][r, offset : offset + n] = np.arange(n)
            batch["segment_ids"][r, offset : offset + n] = segment_id
            # A segment's last token has no target; the mask of the predicted token decides whether it is trained.
            predicting = slice(offset, offset + max(n - 1, 0))
            batch["targets"][r, predicting] = ids[1:]
            batch["loss_mask"][r, predicting] = example.loss_mask[1:n]
            offset += n
    if images is not None:
        batch["pixel_values"] = batch_images(rows, *images)
    return batch


def examples_of(rows: Sequence[PackedRow | SFTExample]) -> list[SFTExample]:
    return [e for row in rows for e in (row.segments if isinstance(row, PackedRow) else [row])]


def image_shape(examples) -> tuple[int, ...] | None:
    """The (C, H, W) of the examples' images (SFT examples or preference pairs), None when none has any."""
    return next((tuple(e.pixel_values.shape[1:]) for e in examples if e.pixel_values is not None), None)


def image_count(rows: Sequence[PackedRow | SFTExample]) -> int:
    return sum(len(e.pixel_values) for e in examples_of(rows) if e.pixel_values is not None)


def batch_images(rows: Sequence[PackedRow | SFTExample], slots: int, shape: tuple[int, ...]) -> np.ndarray:
    """The rows' images in their placeholders' order (row after row, segment after segment), zeros after (a
    batch of text-only rows of a dataset with images: all zeros)."""
    out = np.zeros((slots, *shape), np.float32)
    arrays = [e.pixel_values for e in examples_of(rows) if e.pixel_values is not None]
    taken = np.concatenate(arrays) if arrays else out[:0]
    if len(taken) > slots:
        raise ValueError(f"the batch holds {len(taken)} images, more than its {slots} slots")
    out[:len(taken)] = taken
    return out


def preference_rows(examples: Sequence[PreferenceExample]) -> list[SFTExample]:
    """The 2B rows of B pairs for DPO: rows 0..B-1 prompt + chosen, rows B..2B-1 prompt + rejected, loss on the
    completion tokens only (each row with the prompt's images)."""
    sequences = [_joined(example.prompt_ids, example.chosen_ids, example.pixel_values) for example in examples]
    return sequences + [_joined(example.prompt_ids, example.rejected_ids, example.pixel_values) for example in examples]


def preference_batch(examples: Sequence[PreferenceExample], seq_len: int, *, pad_id: int = 0) -> dict[str, np.ndarray]:
    """A (2B, seq_len) batch of `preference_rows`; keys as in sft_batch."""
    return sft_batch(preference_rows(examples), seq_len, pad_id=pad_id)


class DataOrder:
    """Which items each global step trains on. Epochs are fresh permutations (from (seed, epoch)) laid end to end
    as one endless stream, and step s takes items [s*B, (s+1)*B) of it: a pure function of the step, so resuming
    needs only the step, and every batch is full."""

    def __init__(self, num_items: int, batch_size: int, *, seed: int, shuffle: bool = True):
        if num_items < 1 or batch_size < 1:
            raise ValueError(f"num_items and batch_size must be >= 1, got {num_items} and {batch_size}")
        self.num_items, self.batch_size, self.seed, self.shuffle = num_items, batch_size, seed, shuffle

    def indices(self, step: int) -> np.ndarray:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        start = step * self.batch_size
        first = start // self.num_items
        last = (start + self.batch_size - 1) // self.num_items
        stream = np.concatenate([self._order(epoch) for epoch in range(first, last + 1)])
        offset = start - first * self.num_items
        return stream[offset : offset + self.batch_size]

    def epoch(self, step: int) -> float:
        """Epochs completed before `step` (fractional)."""
        return step * self.batch_size / self.num_items

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_items)
        return np.random.default_rng((self.seed, epoch)).permutation(self.num_items)


# --- helpers --------------------------------------------------------------------------------------------------


def _joined(prompt_ids: np.ndarray, completion_ids: np.ndarray, pixel_values: np.ndarray | None = None) -> SFTExample:
    ids = np.concatenate([prompt_ids, completion_ids])
    return SFTExample(ids, np.arange(len(ids)) >= len(prompt_ids), pixel_values)


def _kind(value) -> str:
    return "null" if value is None else type(value).__name__


def _field(row: dict, name: str, where: str):
    if name not in row:
        raise DataError(f'{where}: field "{name}" is missing (the row has {sorted(row)})')
    return row[name]


def _messages(value, field: str, where: str) -> list[dict]:
    """Check a list of chat messages, naming the field and message at fault."""
    expected = f'field "{field}" must be a non-empty list of {{"role", "content"}} objects'
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {expected}, got {'an empty list' if value == [] else _kind(value)}")
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise DataError(f"{where}: {expected}, but {field}[{i}] is {_kind(message)}")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise DataError(f'{where}: field "{field}[{i}].role" must be one of {", ".join(ROLES)}, got {role!r}')
        content = message.get("content")
        # An assistant turn that only calls tools may leave content out; the template renders its tool_calls.
        if not isinstance(content, str) and not (content is None and role == "assistant" and message.get("tool_calls")):
            note = " (it may be left out only on an assistant turn with tool_calls)" if content is None else ""
            raise DataError(f'{where}: field "{field}[{i}].content" must be a string, got {_kind(content)}{note}')
    return value


def _render(tokenizer: Tokenizer, messages: list[dict], generation_prompt: bool, where: str, expand=None) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt)
    except Exception as e:  # the template is the checkpoint's code: whatever it raises, this row is what it rejects
        raise DataError(f"{where}: the chat template cannot render this row: {type(e).__name__}: {e}") from e
    try:
        return text if expand is None else expand(text)
    except ValueError as e:
        raise DataError(f"{where}: {e}") from None


def _prefix_length(prefix: str, text: str, problem: str) -> int:
    if not text.startswith(prefix):
        raise DataError(problem)
    return len(prefix)


def _with_eos(ids: list[int], tokenizer: Tokenizer) -> list[int]:
    """Completions end with EOS, so the model learns to stop (TRL appends it unless the text already has it)."""
    if tokenizer.eos_token is None:
        raise ValueError("the tokenizer has no EOS token, which ends every trained completion")
    eos = tokenizer.backend.token_to_id(tokenizer.eos_token)
    return ids if ids[-1:] == [eos] else [*ids, eos]


def _keep_trainable(path, numbered: list[tuple[int, tuple]], trainable, max_length: int) -> list:
    kept = [example for _, example in numbered if trainable(example)]
    dropped = [line for line, example in numbered if not trainable(example)]
    if not kept:
        raise DataError(
            f"{path}: no row has a token to train on within max_length={max_length} (assistant turns or "
            "completions truncated away, or missing)"
        )
    if dropped:
        shown = ", ".join(map(str, dropped[:20])) + (", ..." if len(dropped) > 20 else "")
        logger.warning(
            "%s: dropped %d of %d rows with no token to train on within max_length=%d (lines %s)",
            path, len(dropped), len(numbered), max_length, shown,
        )
    return kept
