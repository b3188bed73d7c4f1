"""The engine with images (a tiny random Gemma 3 multimodal model): greedy tokens equal the reference
generator's, an image's placeholders never split between steps, a repeated image hits the prefix cache and a
different one does not, and bad image inputs are errors naming the fault."""

from __future__ import annotations

import numpy as np
import pytest

from tests.models.hf_tiny import VISION, make_hf_gemma3_vision
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.engine.engine import Engine
from tunix_rt.engine.errors import InvalidRequestError
from tunix_rt.engine.params import SamplingParams
from tunix_rt.engine.reference_generator import GenerationConfig, generate

pytest.importorskip("torch")
pytest.importorskip("transformers")

BOI, EOI, IMG = VISION["boi_token_index"], VISION["eoi_token_index"], VISION["image_token_index"]
IMAGE = [BOI, IMG, IMG, IMG, IMG, EOI]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3_vision_engine")
    make_hf_gemma3_vision(out)
    return load_model(out).model


def _pixels(seed: int, n: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 32, 32)).astype(np.float32)


def _engine(model, **kw):
    return Engine(model, None, **{**dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8, block_size=4,
                                         num_kv_blocks=64), **kw})


PROMPTS = [[2, 5, 6, 7, 8, *IMAGE, 7, 8], [2, *IMAGE, 9, 10, 11, *IMAGE, 12]]  # image 0: placeholders 6..9


@pytest.mark.parametrize("batched_tokens", [8, 32])
def test_greedy_with_images_equals_the_reference_generator(model, batched_tokens):
    """Chunks of 8 tokens: the first prompt's image (6..9) would straddle two and is moved whole to the second."""
    pixels = [_pixels(1), _pixels(2, 2)]
    want = [generate(model, [p], GenerationConfig(max_tokens=8), pixel_values=px)[0].token_ids
            for p, px in zip(PROMPTS, pixels)]
    engine = _engine(model, max_num_batched_tokens=batched_tokens)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                           images=[list(pixels[0]), list(pixels[1])])
    assert [o.token_ids for o in outs] == want


def test_the_image_changes_the_output(model):
    engine = _engine(model)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    a, b = (engine.generate([PROMPTS[0]], params, images=[[_pixels(s)[0]]])[0] for s in (1, 3))
    assert a.logprobs != b.logprobs


def test_a_repeated_image_hits_the_prefix_cache(model):
    engine = _engine(model, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = [2, 5, 6, 7, *IMAGE, 8, 9, 10, 11, 12, 13, 14]  # placeholders 5..8: blocks 1 and 2 of 4 tokens
    first = engine.generate([prompt], params, images=[[_pixels(1)[0]]])[0]
    before = engine.stats()
    again = engine.generate([prompt], params, images=[[_pixels(1)[0]]])[0]
    after = engine.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits == 16  # every whole block but the last token's
    assert again.token_ids == first.token_ids
    before = after
    engine.generate([prompt], params, images=[[_pixels(4)[0]]])
    after = engine.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits == 4  # only the block before the image


def test_bad_image_inputs(model):
    engine = _engine(model)
    with pytest.raises(InvalidRequestError, match=r"holds 1 run\(s\) of image placeholders .* for 0 image"):
        engine.add_request(PROMPTS[0])
    with pytest.raises(InvalidRequestError, match=r"for 2 image"):
        engine.add_request(PROMPTS[0], images=list(_pixels(1, 2)))
    with pytest.raises(InvalidRequestError, match="holds 3 tokens, not mm_tokens_per_image"):
        engine.add_request([2, BOI, IMG, IMG, IMG, EOI], images=[_pixels(1)[0]])
    with pytest.raises(InvalidRequestError, match=r"shape \(3, 32, 32\)"):
        engine.add_request(PROMPTS[0], images=[np.zeros((3, 16, 16), np.float32)])
    nan = _pixels(1)[0]
    nan[0, 0, 0] = np.nan
    with pytest.raises(InvalidRequestError, match="finite floats"):
        engine.add_request(PROMPTS[0], images=[nan])
    with pytest.raises(InvalidRequestError, match="exceed max_num_batched_tokens"):
        _engine(model, max_num_batched_tokens=2).add_request(PROMPTS[0], images=[_pixels(1)[0]])
    assert not engine.has_unfinished_requests()


def test_images_on_a_text_model(tmp_path):
    from tests.models.hf_tiny import make_tiny_model_dir

    make_tiny_model_dir(tmp_path, "llama")
    engine = _engine(load_model(tmp_path).model)
    with pytest.raises(InvalidRequestError, match="images given to a text-only llama model"):
        engine.add_request([1, 2, 3], images=[_pixels(1)[0]])
