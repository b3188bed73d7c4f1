"""SFT with images (TRL's vision rows) on a tiny random Gemma 3 multimodal model: the rows' images are placed
and batched, a short run through the CLI teaches the model to name the colour of held-out solid-colour squares
(an answer the text alone cannot give: every prompt is the same), the export loads back, the vision tower stays
frozen unless asked, and bad rows are errors naming the row."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.models.hf_tiny import make_hf_gemma3_vision, make_tiny_model_dir
from tests.train.test_train_cli import cli
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.engine.engine import Engine
from tunix_rt.engine.params import SamplingParams
from tunix_rt.train.data import DataError, load_sft
from tunix_rt.train.image_data import VisionRows, cut, prepare

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile-bound (conftest.fast_compiles says when)

pytest.importorskip("torch")
pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30)}


def _square(path, rgb, rng):
    size = int(rng.integers(20, 60))
    noisy = np.clip(np.asarray(rgb)[None, None] + rng.normal(0, 12, (size, size, 3)), 0, 255).astype(np.uint8)
    Image.fromarray(noisy).save(path)


def _row(image: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
            "images": [image]}


@pytest.fixture(scope="module")
def colours(tmp_path_factory):
    root = tmp_path_factory.mktemp("colours")
    make_hf_gemma3_vision(root / "model")
    (root / "img").mkdir()
    rng = np.random.default_rng(0)
    splits = {}
    for split, n in (("train", 40), ("held", 12)):
        rows = []
        for i in range(n):
            name = list(COLOURS)[i % 4]
            _square(root / "img" / f"{split}{i}.png", COLOURS[name], rng)
            rows.append(_row(f"img/{split}{i}.png", name))
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        splits[split] = rows
    return root, splits


def _answers(model_dir, data_dir, rows):
    loaded = load_model(model_dir)
    vision = VisionRows.for_model(loaded.model.config.vision, loaded.tokenizer, model_dir, data_dir / "train.jsonl")
    prompts, pixels = [], []
    for row in rows:
        prepared = prepare({"messages": row["messages"][:1], "images": row["images"]}, vision)
        text = prepared.expand(loaded.tokenizer.apply_chat_template(prepared.messages, add_generation_prompt=True))
        prompts.append(loaded.tokenizer.encode(text, add_special_tokens=False))
        pixels.append(list(prepared.pixel_values))
    engine = Engine(loaded.model, loaded.tokenizer, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                    block_size=4)
    return [o.text.strip() for o in engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0),
                                                    images=pixels)]


def test_sft_teaches_the_colour_of_held_out_images(colours):
    root, splits = colours
    out = root / "run"
    assert cli("sft", "--model", root / "model", "--data", root / "train.jsonl", "--output", out, "--steps", 20,
               "batch_size=8", "learning_rate=3e-3", "lr_scheduler_type=constant", "warmup_ratio=0",
               "progress=false") == 0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < 0.3 * losses[0]
    held = splits["held"]
    answers = _answers(out / "final", root, held)
    accuracy = np.mean([a == r["messages"][1]["content"][0]["text"] for a, r in zip(answers, held)])
    assert accuracy >= 0.75, answers
    # the answer follows the image: every held-out prompt with a blue square says blue
    blue = [_row(held[2]["images"][0], "blue") for _ in held[:4]]
    assert _answers(out / "final", root, blue) == ["blue"] * 4
    # full fine-tuning left the vision tower as it was (train_vision_tower=false)
    before, after = load_model(root / "model").model, load_model(out / "final").model
    np.testing.assert_array_equal(np.asarray(before.vision.patch_embedding.kernel[...]),
                                  np.asarray(after.vision.patch_embedding.kernel[...]))
    assert not np.array_equal(np.asarray(before.embed.embedding[...]), np.asarray(after.embed.embedding[...]))


def test_vision_rows_are_checked(colours, tmp_path):
    root, splits = colours
    loaded = load_model(root / "model")
    vision = VisionRows.for_model(loaded.model.config.vision, loaded.tokenizer, root / "model", root / "train.jsonl")
    bad = {
        "two image parts, one image": {**_row("img/train0.png", "red"), "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "image"}]},
            {"role": "assistant", "content": "red"}]},
        "a missing file": _row("img/none.png", "red"),
        "an unknown part": {**_row("img/train0.png", "red"), "messages": [
            {"role": "user", "content": [{"type": "audio"}]}, {"role": "assistant", "content": "x"}]},
        "not an image": _row("dGhpcyBpcyBub3QgYW4gaW1hZ2U=", "red"),
        "images without messages": {"prompt": "x", "completion": "y", "images": ["img/train0.png"]},
    }
    expected = {"two image parts, one image": "2 image part", "a missing file": "neither an existing file nor base64",
                "an unknown part": "must be a text part", "not an image": "not an image",
                "images without messages": 'images go with a "messages" row'}
    for name, row in bad.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(DataError, match=rf"{path}:1: .*{expected[name]}"):
            load_sft(path, loaded.tokenizer, max_length=64, vision=vision)


def test_images_to_a_text_model(colours, tmp_path):
    root, _ = colours
    make_tiny_model_dir(tmp_path / "llama", "llama")
    text_model = load_model(tmp_path / "llama")
    with pytest.raises(DataError, match="the model has no vision encoder"):
        load_sft(root / "train.jsonl", text_model.tokenizer, max_length=64, vision=None)


def test_cut_keeps_whole_images_only():
    ids, mask = [1, 7, 7, 7, 2, 7, 7, 7, 3], np.ones(9, bool)
    pixels = np.zeros((2, 3, 4, 4), np.float32)
    assert cut(ids, mask, pixels, 7, 9)[0] == ids
    kept, _, px = cut(ids, mask, pixels, 7, 6)  # the second run (5..7) is cut: the example ends before it
    assert kept == [1, 7, 7, 7, 2] and len(px) == 1
    kept, _, px = cut(ids, mask, pixels, 7, 2)
    assert kept == [1] and px is None
    kept, _, px = cut(ids, mask, pixels, 7, 4)  # the first run ends at the cut: whole
    assert kept == [1, 7, 7, 7] and len(px) == 1


def test_dpo_with_images(colours):
    """DPO rows in TRL's vision format: the prompt's images ride with both rows of the pair; a short run prefers
    the right colour name more than before."""
    root, splits = colours
    rows = []
    for row in splits["train"][:16]:
        right = row["messages"][1]["content"][0]["text"]
        wrong = list(COLOURS)[(list(COLOURS).index(right) + 1) % 4]
        rows.append({"prompt": row["messages"][:1], "images": row["images"],
                     "chosen": [{"role": "assistant", "content": [{"type": "text", "text": right}]}],
                     "rejected": [{"role": "assistant", "content": [{"type": "text", "text": wrong}]}]})
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = root / "dpo"
    assert cli("dpo", "--model", root / "model", "--data", data, "--output", out, "--steps", 8, "batch_size=8",
               "learning_rate=3e-3", "lr_scheduler_type=constant", "warmup_ratio=0", "progress=false") == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    margins = [m["rewards/margins"] for m in metrics if "rewards/margins" in m]
    assert margins[-1] > margins[0] and metrics[-1]["rewards/accuracies"] >= 0.75
    bad = dict(rows[0])
    del bad["prompt"]
    bad["chosen"] = rows[0]["prompt"] + rows[0]["chosen"]
    bad["rejected"] = rows[0]["prompt"] + rows[0]["rejected"]
    (root / "bad.jsonl").write_text(json.dumps(bad) + "\n")
    loaded = load_model(root / "model")
    vision = VisionRows.for_model(loaded.model.config.vision, loaded.tokenizer, root / "model", root / "bad.jsonl")
    from tunix_rt.train.data import load_preferences

    with pytest.raises(DataError, match='needs a "prompt" field'):
        load_preferences(root / "bad.jsonl", loaded.tokenizer, max_length=64, vision=vision)


def test_typed_placeholders_and_text_rows_beside_images(colours, tmp_path):
    """Placeholder tokens typed in a row's text are refused (they would take another row's image); a dataset
    mixing text-only rows with image rows batches both (a text-only batch's image slots are zeros)."""
    from tunix_rt.train.sft import SFTObjective

    root, splits = colours
    loaded = load_model(root / "model")
    vision = VisionRows.for_model(loaded.model.config.vision, loaded.tokenizer, root / "model", root / "train.jsonl")
    typed = {"messages": [{"role": "user", "content": "<image_soft_token> colour?"},
                          {"role": "assistant", "content": "red"}]}
    path = tmp_path / "typed.jsonl"
    path.write_text(json.dumps(typed) + "\n")
    with pytest.raises(DataError, match="must not contain the image tokens"):
        load_sft(path, loaded.tokenizer, max_length=64, vision=vision)
    text = {"messages": [{"role": "user", "content": "colour?"}, {"role": "assistant", "content": "none"}]}
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [text, text, splits["train"][0]]))
    examples = load_sft(path, loaded.tokenizer, max_length=64, vision=vision)
    objective = SFTObjective(examples, max_length=64, pad_id=0)
    idx = np.array([0, 1])
    batch = objective.host_batch(idx, np.ones(2, bool), objective.batch_lengths(idx))
    assert batch["pixel_values"].shape == (1, 3, 32, 32) and not batch["pixel_values"].any()
