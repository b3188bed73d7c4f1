"""SFT/DPO data: TRL's row formats -> ids and loss masks (checked by decoding what is trained), errors that name
the file, line and field, fixed-shape packed batches, and a resumable batch order."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from tunix_rt.checkpoints import gguf_loader
from tunix_rt.checkpoints.default_model import DefaultModelMissing, default_model_path
from tunix_rt.checkpoints.tokenizer import Tokenizer
from tunix_rt.train.data import (
    DataError,
    DataOrder,
    PreferenceExample,
    SFTExample,
    load_preferences,
    load_sft,
    pack,
    preference_batch,
    read_jsonl,
    sft_batch,
    tokenize_preference,
    tokenize_sft,
)

WHERE = "data.jsonl:1"
SYSTEM = {"role": "system", "content": "Be brief."}
TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
]


@pytest.fixture(scope="module")
def smol():
    """SmolLM2-135M-Instruct's tokenizer (ChatML; a default system message when the first is not a system one)."""
    try:
        path = default_model_path()
    except DefaultModelMissing as e:
        pytest.skip(str(e))
    return Tokenizer.from_gguf(gguf_loader.open_gguf(path))


# A word-level tokenizer with a Llama-3-style template: BOS added by encode and written by the template.
WORDS = ["<unk>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
WORDS += "system user assistant tool be brief hi hello there how are you fine thanks ok bye call get_weather".split()
LLAMA_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|> "
    "{% if m.tool_calls %}call {{ m.tool_calls[0].function.name }}{% else %}{{ m.content }}{% endif %}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|> {% endif %}"
)


def tiny(template: str = LLAMA_STYLE) -> Tokenizer:
    backend = Backend(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(word, special=True, normalized=False) for word in WORDS[1:5]])
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 1)]
    )
    return Tokenizer(backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", chat_template=template)


def ids_of(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def trained_runs(example: SFTExample) -> list[list[int]]:
    """The ids of each maximal run of trained tokens."""
    runs, previous = [], False
    for token, trained in zip(example.input_ids.tolist(), example.loss_mask.tolist()):
        if trained and not previous:
            runs.append([])
        if trained:
            runs[-1].append(token)
        previous = trained
    return runs


def write_jsonl(tmp_path, *lines) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


# --- SFT rows -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("messages", [[SYSTEM, *TURNS], TURNS], ids=["system", "default-system"])
def test_messages_train_on_every_assistant_turn(smol, messages):
    example = tokenize_sft({"messages": messages}, smol, max_length=1024, where=WHERE)
    text = smol.apply_chat_template(messages, add_generation_prompt=False)
    assert example.input_ids.dtype == np.int32 and example.input_ids.tolist() == ids_of(smol, text)
    assert [smol.decode(run, skip_special_tokens=False) for run in trained_runs(example)] == [
        "Hello! How can I help?<|im_end|>\n",
        "4.<|im_end|>\n",
    ]


def test_messages_without_assistant_only_loss_train_on_everything(smol):
    example = tokenize_sft({"messages": TURNS}, smol, max_length=1024, where=WHERE, assistant_only_loss=False)
    assert example.loss_mask.all()


def test_messages_with_another_template():
    tok = tiny()
    row = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "bye"},
                        {"role": "assistant", "content": "bye"}]}  # fmt: skip
    example = tokenize_sft(row, tok, max_length=100, where=WHERE)
    assert example.input_ids[0] == tok.bos_token_id
    assert trained_runs(example) == [ids_of(tok, "hello there<|eot_id|>"), ids_of(tok, "bye<|eot_id|>")]


def test_tool_call_turn_without_content_is_rendered_by_the_template():
    tok = tiny()
    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "get_weather"}}]}
    messages = [{"role": "user", "content": "hi"}, call, {"role": "tool", "content": "fine"},
                {"role": "assistant", "content": "ok"}]  # fmt: skip
    example = tokenize_sft({"messages": messages}, tok, max_length=100, where=WHERE)
    assert trained_runs(example) == [ids_of(tok, "call get_weather<|eot_id|>"), ids_of(tok, "ok<|eot_id|>")]


def test_prompt_completion_strings_end_with_eos(smol):
    row = {"prompt": "The capital of France is", "completion": " Paris.", "extra": 1}
    example = tokenize_sft(row, smol, max_length=1024, where=WHERE)
    prompt, completion = smol.encode(row["prompt"]), ids_of(smol, row["completion"])
    eos = smol.eos_token_ids[0]
    assert example.input_ids.tolist() == prompt + completion + [eos]
    assert example.loss_mask.tolist() == [False] * len(prompt) + [True] * (len(completion) + 1)
    everything = tokenize_sft(row, smol, max_length=1024, where=WHERE, completion_only_loss=False)
    assert everything.loss_mask.all()


def test_prompt_completion_strings_add_bos_and_no_second_eos():
    tok = tiny()
    example = tokenize_sft({"prompt": "hi", "completion": "hello<|eot_id|>"}, tok, max_length=10, where=WHERE)
    assert example.input_ids.tolist() == [tok.bos_token_id, *ids_of(tok, "hi hello<|eot_id|>")]
    assert trained_runs(example) == [ids_of(tok, "hello<|eot_id|>")]


def test_conversational_prompt_completion_trains_on_the_completion(smol):
    prompt = [SYSTEM, *TURNS[:3]]
    row = {"prompt": prompt, "completion": [TURNS[3]]}
    example = tokenize_sft(row, smol, max_length=1024, where=WHERE)
    text = smol.apply_chat_template(prompt + [TURNS[3]], add_generation_prompt=False)
    assert example.input_ids.tolist() == ids_of(smol, text)
    # Only the completion's turn: the earlier assistant turn in the prompt is context.
    assert [smol.decode(run, skip_special_tokens=False) for run in trained_runs(example)] == ["4.<|im_end|>\n"]
    both_turns = tokenize_sft(row, smol, max_length=1024, where=WHERE, completion_only_loss=False)
    assert len(trained_runs(both_turns)) == 2
    whole_completion = tokenize_sft(row, smol, max_length=1024, where=WHERE, assistant_only_loss=False)
    assert smol.decode(whole_completion.input_ids[whole_completion.loss_mask], skip_special_tokens=False) == (
        "4.<|im_end|>\n"
    )


def test_text_rows_train_on_everything_and_end_with_eos(smol):
    example = tokenize_sft({"text": "Once upon a time"}, smol, max_length=1024, where=WHERE)
    assert example.input_ids.tolist() == smol.encode("Once upon a time") + [smol.eos_token_ids[0]]
    assert example.loss_mask.all() and example.loss_mask.dtype == bool


def test_truncation_keeps_the_first_tokens(smol):
    full = tokenize_sft({"messages": TURNS}, smol, max_length=1024, where=WHERE)
    cut = tokenize_sft({"messages": TURNS}, smol, max_length=40, where=WHERE)
    assert cut.input_ids.tolist() == full.input_ids[:40].tolist()
    assert cut.loss_mask.tolist() == full.loss_mask[:40].tolist()
    no_assistant_left = tokenize_sft({"messages": TURNS}, smol, max_length=5, where=WHERE)
    assert len(no_assistant_left.input_ids) == 5 and not no_assistant_left.loss_mask.any()


def test_template_whose_renders_are_not_prefixes_is_refused():
    marks_last = LLAMA_STYLE.replace("{% endif %}<|eot_id|>", "{% endif %}{% if loop.last %} ok{% endif %}<|eot_id|>")
    tok = tiny(marks_last)
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    with pytest.raises(DataError, match=r"^data.jsonl:1: assistant-only loss .* assistant_only_loss=False"):
        tokenize_sft(row, tok, max_length=100, where=WHERE)
    assert tokenize_sft(row, tok, max_length=100, where=WHERE, assistant_only_loss=False).loss_mask.all()
    split = {"prompt": row["messages"][:1], "completion": row["messages"][1:]}
    with pytest.raises(DataError, match=r"^data.jsonl:1: completion-only loss .* completion_only_loss=False"):
        tokenize_sft(split, tok, max_length=100, where=WHERE, assistant_only_loss=False)
    with pytest.raises(DataError, match='^data.jsonl:1: .* not a prefix .* "chosen" tokens'):
        pair = {"prompt": split["prompt"], "chosen": split["completion"], "rejected": split["completion"]}
        tokenize_preference(pair, tok, max_length=100, where=WHERE)


def test_template_exceptions_become_data_errors():
    tok = tiny("{% if messages[0].role != 'user' %}{{ raise_exception('start with a user turn') }}{% endif %}")
    row = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    with pytest.raises(DataError, match="^data.jsonl:1: the chat template .*start with a user turn"):
        tokenize_sft(row, tok, max_length=100, where=WHERE)


# --- files and bad rows ---------------------------------------------------------------------------------------

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    "line, field",
    [
        ({"foo": 1}, '"messages"'),
        ({"messages": "hi"}, 'field "messages" must be a non-empty list of {"role", "content"} objects, got str'),
        ({"messages": []}, "got an empty list"),
        ({"messages": ["hi"]}, r"messages\[0\] is str"),
        ({"messages": [{"content": "hi"}]}, r'"messages\[0\].role" must be one of'),
        ({"messages": [USER, {"role": "robot", "content": "x"}]}, r"\"messages\[1\].role\" .* got 'robot'"),
        ({"messages": [{"role": "user", "content": 3}]}, r'"messages\[0\].content" must be a string, got int'),
        ({"messages": [USER, {"role": "assistant"}]}, r'"messages\[1\].content" must be a string, got null'),
        ({"prompt": "hi"}, 'field "completion" is missing'),
        ({"completion": "hi"}, 'field "prompt" is missing'),
        ({"prompt": "hi", "completion": [USER]}, '"prompt" and "completion" must both be .* got str and list'),
        ({"prompt": [USER], "completion": [{"role": "assistant", "content": None}]}, r'"completion\[0\].content"'),
        ({"text": 5}, 'field "text" must be a string, got int'),
        ('{"text": "hi",}', "invalid JSON"),
        ("[1, 2]", "a row must be a JSON object, got list"),
    ],
)
def test_bad_sft_rows_name_the_line_and_field(tmp_path, line, field):
    path = write_jsonl(tmp_path, GOOD, "", line, GOOD)
    with pytest.raises(DataError, match=f"^{path}:3: .*{field}"):
        load_sft(path, tiny(), max_length=100)


@pytest.mark.parametrize(
    "line, field",
    [
        ({"prompt": "hi", "rejected": "bye"}, 'field "chosen" is missing'),
        ({"prompt": "hi", "chosen": "ok"}, 'field "rejected" is missing'),
        ({"chosen": "hi ok", "rejected": "hi bye"}, 'field "prompt" is missing'),
        ({"prompt": "hi", "chosen": [USER], "rejected": "bye"}, "all be strings or all be lists.* str, list and str"),
        ({"prompt": [USER], "chosen": [{"role": "bot", "content": "x"}], "rejected": [USER]}, r'"chosen\[0\].role"'),
        ({"chosen": [USER], "rejected": [{"role": "system", "content": "hi"}]}, "must start with the same messages"),
        ({"chosen": [USER, USER], "rejected": [USER]}, 'field "rejected" has no messages after the prompt'),
    ],
)
def test_bad_preference_rows_name_the_line_and_field(tmp_path, line, field):
    good = {"prompt": "hi", "chosen": "hello", "rejected": "bye"}
    path = write_jsonl(tmp_path, good, good, line)
    with pytest.raises(DataError, match=f"^{path}:3: .*{field}"):
        load_preferences(path, tiny(), max_length=100)


def test_read_jsonl_numbers_lines_and_skips_blank_ones(tmp_path):
    path = write_jsonl(tmp_path, "", {"text": "a\u2028b"}, "  ", {"text": "c"})
    assert read_jsonl(path) == [(2, {"text": "a\u2028b"}), (4, {"text": "c"})]


def test_missing_or_empty_dataset_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: cannot read"):
        read_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="has no rows"):
        read_jsonl(write_jsonl(tmp_path, "", " "))


def test_load_sft_drops_rows_with_nothing_left_to_train_on(tmp_path, caplog):
    tok = tiny()
    long = {"messages": [{"role": "user", "content": "hi " * 20}, {"role": "assistant", "content": "ok"}]}
    path = write_jsonl(tmp_path, GOOD, long, {"text": "hi"})
    with caplog.at_level(logging.WARNING, logger="tunix_rt.train.data"):
        examples = load_sft(path, tok, max_length=12)
    assert len(examples) == 2
    assert "dropped 1 of 3 rows" in caplog.text and "(lines 2)" in caplog.text
    with pytest.raises(DataError, match="no row has a token to train on within max_length=12"):
        load_sft(write_jsonl(tmp_path, long), tok, max_length=12)


# --- DPO rows -------------------------------------------------------------------------------------------------


def test_preference_strings(smol):
    row = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    example = tokenize_preference(row, smol, max_length=1024, where=WHERE)
    eos = smol.eos_token_ids[0]
    assert example.prompt_ids.tolist() == smol.encode("The sky is")
    assert example.chosen_ids.tolist() == ids_of(smol, " blue.") + [eos]
    assert example.rejected_ids.tolist() == ids_of(smol, " green.") + [eos]
    assert example.chosen_ids.dtype == np.int32


def test_preference_conversations_explicit_and_implicit_prompt(smol):
    prompt = [SYSTEM, {"role": "user", "content": "Capital of France?"}]
    chosen, rejected = [{"role": "assistant", "content": "Paris."}], [{"role": "assistant", "content": "Rome."}]
    example = tokenize_preference(
        {"prompt": prompt, "chosen": chosen, "rejected": rejected}, smol, max_length=1024, where=WHERE
    )
    assert smol.decode(example.prompt_ids, skip_special_tokens=False) == smol.apply_chat_template(prompt)
    assert smol.decode(example.chosen_ids, skip_special_tokens=False) == "Paris.<|im_end|>\n"
    assert smol.decode(example.rejected_ids, skip_special_tokens=False) == "Rome.<|im_end|>\n"
    implicit = tokenize_preference(
        {"chosen": prompt + chosen, "rejected": prompt + rejected}, smol, max_length=1024, where=WHERE
    )
    assert all(np.array_equal(a, b) for a, b in zip(implicit, example))


def test_preference_truncation_keeps_the_prompt_end_then_the_sequence_start():
    tok = tiny()
    row = {"prompt": "hi how are you", "chosen": "fine thanks", "rejected": "ok"}
    bos, eos = tok.bos_token_id, tok.eos_token_ids[0]
    example = tokenize_preference(row, tok, max_length=5, max_prompt_length=3, where=WHERE)
    assert example.prompt_ids.tolist() == ids_of(tok, "how are you")
    assert example.chosen_ids.tolist() == ids_of(tok, "fine thanks")
    assert example.rejected_ids.tolist() == ids_of(tok, "ok") + [eos]
    long_prompt = tokenize_preference(row, tok, max_length=4, where=WHERE)
    assert long_prompt.prompt_ids.tolist() == [bos, *ids_of(tok, "hi how are")]
    assert len(long_prompt.chosen_ids) == len(long_prompt.rejected_ids) == 0


def test_load_preferences_drops_pairs_truncated_to_nothing(tmp_path, caplog):
    short = {"prompt": "hi", "chosen": "fine", "rejected": "ok"}
    long = {"prompt": "hi how are you", "chosen": "fine", "rejected": "ok"}
    with caplog.at_level(logging.WARNING, logger="tunix_rt.train.data"):
        examples = load_preferences(write_jsonl(tmp_path, long, short), tiny(), max_length=4)
    assert len(examples) == 1 and "(lines 1)" in caplog.text
    with pytest.raises(DataError, match="no row has a token to train on"):
        load_preferences(write_jsonl(tmp_path, long), tiny(), max_length=4)


# --- batching -------------------------------------------------------------------------------------------------


def example(ids, mask=None) -> SFTExample:
    return SFTExample(np.asarray(ids, np.int32), np.ones(len(ids), bool) if mask is None else np.asarray(mask, bool))


def test_pack_is_greedy_in_order_and_cuts_long_examples():
    lengths = [3, 4, 5, 2, 9]
    rows = pack([example(range(100 * i, 100 * i + n)) for i, n in enumerate(lengths)], seq_len=8)
    assert [[len(s.input_ids) for s in row.segments] for row in rows] == [[3, 4], [5, 2], [8]]
    assert rows[2].segments[0].input_ids.tolist() == list(range(400, 408))


def test_packed_batch_keeps_segments_apart():
    rows = pack([example([1, 2, 3], [0, 1, 1]), example([4, 5, 6, 7], [0, 0, 1, 1])], seq_len=9)
    batch = sft_batch(rows, 9, pad_id=99)
    assert batch["tokens"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 99, 99]]
    assert batch["positions"].tolist() == [[0, 1, 2, 0, 1, 2, 3, -1, -1]]
    assert batch["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 2, 2, 0, 0]]
    # Segment ends (index 2, 6) and padding predict nothing: the target never crosses into the next segment.
    assert batch["targets"].tolist() == [[2, 3, 0, 5, 6, 7, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 0, 1, 1, 0, 0, 0]]
    assert {k: v.dtype for k, v in batch.items()} == {
        "tokens": np.int32, "positions": np.int32, "segment_ids": np.int32, "targets": np.int32,
        "loss_mask": np.float32,
    }  # fmt: skip


def test_unpacked_batch_has_one_example_per_row_cut_to_seq_len():
    batch = sft_batch([example([1, 2]), example([3, 4, 5, 6, 7])], 4)
    assert batch["tokens"].tolist() == [[1, 2, 0, 0], [3, 4, 5, 6]]
    assert batch["segment_ids"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch["targets"].tolist() == [[2, 0, 0, 0], [4, 5, 6, 0]]
    assert batch["loss_mask"].tolist() == [[1, 0, 0, 0], [1, 1, 1, 0]]


@settings(max_examples=60)
@given(
    masks=st.lists(st.lists(st.booleans(), min_size=1, max_size=20), min_size=1, max_size=12),
    seq_len=st.integers(1, 24),
)
def test_packing_loses_no_trained_token(masks, seq_len):
    rng = np.random.default_rng(len(masks))
    examples = [example(rng.integers(1, 1000, len(mask)), mask) for mask in masks]
    unpacked = sft_batch(examples, seq_len)
    packed = sft_batch(pack(examples, seq_len), seq_len)
    for batch in (unpacked, packed):
        assert (batch["loss_mask"][batch["segment_ids"] == 0] == 0).all()
    assert packed["loss_mask"].sum() == unpacked["loss_mask"].sum()
    trained = sorted(packed["targets"][packed["loss_mask"] > 0].tolist())
    assert trained == sorted(unpacked["targets"][unpacked["loss_mask"] > 0].tolist())


def test_preference_batch_stacks_chosen_then_rejected():
    examples = [
        PreferenceExample(*(np.asarray(x, np.int32) for x in ([1, 2], [3, 4], [5]))),
        PreferenceExample(*(np.asarray(x, np.int32) for x in ([6], [7, 8, 9], [10, 11]))),
    ]
    batch = preference_batch(examples, 5, pad_id=0)
    assert batch["tokens"].tolist() == [[1, 2, 3, 4, 0], [6, 7, 8, 9, 0], [1, 2, 5, 0, 0], [6, 10, 11, 0, 0]]
    # Loss where the target is a completion token: the prompt's last token onwards.
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0, 0], [1, 1, 1, 0, 0], [0, 1, 0, 0, 0], [1, 1, 0, 0, 0]]
    assert batch["segment_ids"].max() == 1


# --- batch order ----------------------------------------------------------------------------------------------


def test_data_order_epochs_are_permutations_and_deterministic():
    order = DataOrder(10, 3, seed=7)
    stream = np.concatenate([order.indices(step) for step in range(10)])  # 30 items: three whole epochs
    epochs = stream.reshape(3, 10)
    assert all(sorted(epoch) == list(range(10)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3  # a fresh order each epoch
    again = DataOrder(10, 3, seed=7)
    assert all(np.array_equal(again.indices(step), order.indices(step)) for step in range(10))
    assert order.epoch(10) == 3.0 and order.epoch(5) == 1.5


def test_data_order_indices_are_a_pure_function_of_the_step():
    order = DataOrder(7, 4, seed=0)
    later = order.indices(11)
    assert [len(order.indices(step)) for step in range(5)] == [4] * 5  # full batches across epoch ends
    assert np.array_equal(DataOrder(7, 4, seed=0).indices(11), later)
    assert np.array_equal(order.indices(11), later)


def test_data_order_seeds_and_shuffle():
    orders = [np.concatenate([DataOrder(50, 10, seed=seed).indices(s) for s in range(5)]) for seed in (0, 1)]
    assert not np.array_equal(*orders)
    plain = DataOrder(5, 3, seed=0, shuffle=False)
    assert [plain.indices(step).tolist() for step in range(3)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3]]
    big = DataOrder(2, 5, seed=0)  # a batch larger than the dataset spans several epochs
    assert sorted(big.indices(0).tolist()[:4]) == [0, 0, 1, 1]


# --- bucketed lengths and the head window ----------------------------------------------------------------------


def test_packed_lengths():
    from tunix_rt.train.data import packed_length

    assert [packed_length(n) for n in (0, 1, 16, 17, 128, 129, 200, 257, 513, 570, 1025)] == \
        [16, 16, 16, 32, 128, 144, 208, 288, 576, 576, 1152]
    assert all(n <= packed_length(n) < max(1.125 * n, n + 16) for n in range(1, 5000))  # padding under an eighth
    assert len({packed_length(n) for n in range(513, 1025)}) == 8


def test_bucket_lengths():
    from tunix_rt.train.data import bucket_length

    assert [bucket_length(n) for n in (0, 1, 16, 17, 42, 64, 65, 97, 129, 193, 257, 385, 513, 769, 1500)] == \
        [16, 16, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536]
    assert bucket_length(500, 500) == 500 and bucket_length(100, 96) == 128  # capped only when the row fits
    assert len({bucket_length(n) for n in range(1, 513)}) == 10
    assert all(bucket_length(n) < 1.5 * n for n in range(49, 5000))  # padding under a third past 48


def test_harmonized_lengths_give_one_shape_per_row_length():
    from tunix_rt.train.data import harmonized_lengths

    assert harmonized_lengths([(64, 128), (128, 256), (64, 192), (64, 96)]) == {64: (64, 192), 128: (128, 256)}


@settings(max_examples=50)
@given(masks=st.lists(st.lists(st.booleans(), min_size=1, max_size=12), min_size=1, max_size=5),
       extra=st.integers(0, 5))
def test_head_window_holds_every_trained_target(masks, extra):
    from tunix_rt.train.data import head_window, trained_tokens

    examples = [SFTExample(np.arange(1, len(m) + 1, dtype=np.int32) * 10 + i, np.array(m)) for i, m in enumerate(masks)]
    batch = sft_batch(examples, 12)
    count = trained_tokens(examples)
    window = head_window(batch["loss_mask"], batch["targets"], count + extra)
    flat_mask, flat_targets = batch["loss_mask"].reshape(-1), batch["targets"].reshape(-1)
    used = window["head_mask"] > 0
    assert used.sum() == count == (flat_mask > 0).sum()
    np.testing.assert_array_equal(window["head_targets"][used], flat_targets[window["head_index"][used]])
    np.testing.assert_array_equal(window["head_row"][used], window["head_index"][used] // 12)
    assert (window["head_mask"][~used] == 0).all() and (window["head_targets"][~used] == 0).all()
    if count:
        with pytest.raises(ValueError, match="more than its head window"):
            head_window(batch["loss_mask"], batch["targets"], count - 1)
