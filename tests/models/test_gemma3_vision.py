"""Gemma 3 with images (models/vision.py, models/image_processor.py): log-probs against transformers'
Gemma3ForConditionalGeneration on a tiny random config, pixel values against HF's Gemma3 image processor,
the image tokens' two-way attention, and the errors of bad images and mismatched placeholders."""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.models.hf_tiny import VISION, make_hf_gemma3_vision
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.models.image_processor import ImageError, ImageProcessor, decode_image
from tunix_rt.models.vision import image_attend_until

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile-bound (conftest.fast_compiles says when)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

BOI, EOI, IMG = VISION["boi_token_index"], VISION["eoi_token_index"], VISION["image_token_index"]


def _image(n: int = 4) -> list[int]:
    return [BOI, *[IMG] * n, EOI]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3_vision")
    return make_hf_gemma3_vision(out), load_model(out).model, out


def _hf_logprobs(hf, tokens, pixels):
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(pixels),
                    token_type_ids=torch.tensor((np.asarray(tokens) == IMG).astype(np.int64))).logits.float()
    return torch.log_softmax(logits, -1).numpy()


def test_logprobs_with_images_match_hf(pair):
    """Two rows, three images (one row with two, the second past the sliding window of the first), text between."""
    hf, ours, _ = pair
    rows = [[2, 5, *_image(), 7, 8, 9, *_image(), 10, 11, 12, 13],
            [2, *_image(), 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33]]
    tokens = np.asarray(rows)
    pixels = np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)
    ref = _hf_logprobs(hf, tokens, pixels)
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    got = np.asarray(jax.nn.log_softmax(ours(jnp.asarray(tokens), jnp.asarray(positions),
                                             pixel_values=jnp.asarray(pixels)), -1))
    assert np.abs(got - ref).max() <= 1e-4
    with torch.no_grad():  # the images' two-way attention is what makes them agree: HF without it differs
        causal = torch.log_softmax(hf(input_ids=torch.tensor(tokens), pixel_values=torch.tensor(pixels)).logits, -1)
    assert np.abs(causal.numpy() - ref).max() > 1e-2


def test_image_tokens_see_their_whole_image_only():
    tokens = jnp.asarray([[1, IMG, IMG, IMG, 2, IMG, IMG, 3]])
    positions = jnp.arange(8)[None] + 10
    assert image_attend_until(tokens, positions, IMG).tolist() == [[10, 13, 13, 13, 14, 16, 16, 17]]


def test_text_prompts_on_a_multimodal_checkpoint(pair):
    """Without images the model is its text decoder (HF run without pixel values)."""
    hf, ours, _ = pair
    tokens = np.random.default_rng(1).integers(0, 100, (1, 12))
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=torch.tensor(tokens)).logits.float(), -1).numpy()
    got = jax.nn.log_softmax(ours(jnp.asarray(tokens), jnp.arange(12)[None]), -1)
    assert np.abs(np.asarray(got) - ref).max() <= 1e-4


def test_placeholder_and_pixel_errors(pair):
    _, ours, _ = pair
    tokens = jnp.asarray([[2, *_image(3), 7]])  # 3 placeholders for an image of 4 soft tokens
    positions = jnp.arange(tokens.shape[1])[None]
    with pytest.raises(ValueError, match="need 4 placeholder tokens"):
        ours(tokens, positions, pixel_values=jnp.zeros((1, 3, 32, 32)))
    tokens = jnp.asarray([[2, *_image(), 7]])
    with pytest.raises(ValueError, match=r"pixel_values must be \(images, 3, 32, 32\)"):
        ours(tokens, jnp.arange(7)[None], pixel_values=jnp.zeros((1, 3, 16, 16)))


def test_pixels_on_a_text_model(tmp_path):
    from tests.models.hf_tiny import make_tiny_model_dir

    make_tiny_model_dir(tmp_path, "llama")
    model = load_model(tmp_path).model
    with pytest.raises(ValueError, match="images given to a text-only llama model"):
        model(jnp.asarray([[1, 2]]), jnp.arange(2)[None], pixel_values=jnp.zeros((1, 3, 32, 32)))


def _random_images():
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in
              ((37, 53), (300, 900), (800, 260), (64, 64))]
    return images + [Image.fromarray(rng.integers(0, 256, (40, 30, 4), dtype=np.uint8), "RGBA")]


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_pixel_values_equal_hf_processor(pan_and_scan):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    images = _random_images()
    hf = Gemma3ImageProcessorPil(size={"height": 48, "width": 48}, do_pan_and_scan=pan_and_scan,
                                 pan_and_scan_min_crop_size=100, pan_and_scan_max_num_crops=4,
                                 pan_and_scan_min_ratio_to_activate=1.2)(images, return_tensors="np")
    encoded = []
    for image in images:  # through PNG bytes, as users send them
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        encoded.append(decode_image(buffer.getvalue()))
    ours, crops = ImageProcessor(size=48, do_pan_and_scan=pan_and_scan, pan_and_scan_min_crop_size=100).pixel_values(
        encoded)
    assert crops == [int(c) for c in hf["num_crops"]]
    assert (crops != [0] * 5) == pan_and_scan
    np.testing.assert_array_equal(ours, hf["pixel_values"])


def test_processor_reads_the_checkpoint_settings(pair, tmp_path):
    _, ours, out = pair
    assert ImageProcessor.for_model(ours.config.vision, out).size == 32  # no preprocessor_config.json: defaults
    (tmp_path / "preprocessor_config.json").write_text(
        '{"size": {"height": 32, "width": 32}, "image_mean": [0.1, 0.2, 0.3], "do_pan_and_scan": true}')
    processor = ImageProcessor.for_model(ours.config.vision, tmp_path)
    assert processor.image_mean == (0.1, 0.2, 0.3) and processor.do_pan_and_scan
    (tmp_path / "preprocessor_config.json").write_text('{"size": {"height": 64, "width": 64}}')
    with pytest.raises(ValueError, match="not the vision tower's 32x32"):
        ImageProcessor.for_model(ours.config.vision, tmp_path)


def test_bad_images_are_named():
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(buffer, format="PNG")
    png = buffer.getvalue()
    with pytest.raises(ImageError, match="not an image"):
        decode_image(b"GIF89a but not really" * 3)
    with pytest.raises(ImageError, match="cannot be decoded"):
        decode_image(png[: len(png) // 2])
    with pytest.raises(ImageError, match="outside 1..1000 pixels"):
        decode_image(png, max_pixels=1000)
    assert decode_image(png).size == (64, 64)


def test_dense_cache_prefill_with_images_then_decode(pair):
    """A prompt with an image prefilled into the dense KV cache, then decoded a token at a time: the logits of
    the forward over the whole sequence at once."""
    _, ours, _ = pair
    tokens = jnp.asarray([[2, 5, *_image(), 7, 8, 9, 10]])
    pixels = jnp.asarray(np.random.default_rng(3).standard_normal((1, 3, 32, 32)), jnp.float32)
    full = ours(tokens, jnp.arange(12)[None], pixel_values=pixels)
    cache = ours.new_cache(1, 16)
    prefill, cache = ours(tokens[:, :9], jnp.arange(9)[None], cache, pixel_values=pixels)
    steps = [prefill]
    for t in range(9, 12):
        logits, cache = ours(tokens[:, t:t + 1], jnp.asarray([[t]]), cache)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate([np.asarray(s) for s in steps], axis=1), np.asarray(full), atol=2e-5)


def test_hf_export_loads_in_transformers(pair, tmp_path):
    """Our export (transformers 5's names; the patch convolution unflattened) is the same model to transformers."""
    from transformers import Gemma3ForConditionalGeneration

    from tunix_rt.checkpoints.gguf_export import GGUFExportError, export_gguf
    from tunix_rt.checkpoints.hf_export import export_hf

    hf, _, out = pair
    loaded = load_model(out)
    export_hf(loaded.model, loaded.tokenizer, loaded.hf_config, tmp_path / "export")
    back = Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "export").eval()
    tokens = [[2, 5, *_image(), 9, 10]]
    pixels = np.random.default_rng(5).standard_normal((1, 3, 32, 32)).astype(np.float32)
    np.testing.assert_allclose(_hf_logprobs(back, tokens, pixels), _hf_logprobs(hf, tokens, pixels), atol=1e-5)
    assert load_model(tmp_path / "export").model.config == loaded.model.config
    with pytest.raises(GGUFExportError, match="mmproj"):
        export_gguf(loaded.model, loaded.tokenizer, tmp_path / "m.gguf")
