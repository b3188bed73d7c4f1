"""Chat with images through `tunix-rt serve` on a tiny random Gemma 3 multimodal model: a base64 PNG through the
openai client gives the engine's own greedy reply for the same prompt and pixels; bad images (not an image,
truncated, a remote URL, an unknown media type, too many) are 400s in OpenAI's envelope naming the fault."""

from __future__ import annotations

import base64
import io

import httpx2 as httpx
import numpy as np
import pytest

from serving.images import place_images, take_images
from tests.models.hf_tiny import make_hf_gemma3_vision
from tests.serving.conftest import running_server
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.engine.engine import Engine
from tunix_rt.engine.params import SamplingParams
from tunix_rt.models.image_processor import ImageProcessor, ImageTokensText
from tunix_rt.tools.chat import render_chat
from tunix_rt.tools.tool_calls import tool_format_for

pytest.importorskip("torch")
pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
openai = pytest.importorskip("openai")

ENGINE_ARGS = ["--max-model-len", "96", "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--block-size", "4",
               "--limit-mm-per-prompt", '{"image": 2}']


def _png(seed: int, size=(40, 24)) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def _tiff() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buffer, "TIFF")
    return buffer.getvalue()


def _url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def _messages(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, *parts]}]


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("gemma3_vision_serve")
    make_hf_gemma3_vision(model_dir)
    log_path = str(tmp_path_factory.mktemp("serve_vision") / "serve.log")
    with running_server(["--model", model_dir, *ENGINE_ARGS], log_path) as (base, _):
        yield base, model_dir


def test_chat_with_a_base64_image_through_openai(vision_server):
    base, model_dir = vision_server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    messages = _messages(_url(_png(1)))
    reply = client.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=6, temperature=0)
    # the same request offline: the template, the image placed as the processor places it, the engine's greedy tokens
    loaded = load_model(model_dir)
    chat = take_images(messages, 2)
    prompt = render_chat(loaded.tokenizer, chat.messages, tool_format_for(loaded.tokenizer.chat_template), None)
    vision = loaded.model.config.vision
    prompt, pixels = place_images(prompt, chat, ImageProcessor.for_model(vision, model_dir),
                                  ImageTokensText.of(loaded.tokenizer, vision))
    engine = Engine(loaded.model, loaded.tokenizer, max_model_len=96, max_num_seqs=2, max_num_batched_tokens=32,
                    block_size=4)
    want = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0), images=[pixels])[0]
    assert reply.choices[0].message.content == want.text
    assert reply.usage.prompt_tokens == len(want.prompt_token_ids)
    assert want.prompt_token_ids.count(vision.image_token_id) == vision.mm_tokens_per_image


@pytest.mark.parametrize("url,fault", [
    (_url(b"not an image at all" * 4), "not an image"),
    (_url(_png(2)[:60]), "cannot be decoded"),
    ("https://example.com/cat.png", "remote images are not fetched"),
    ("file:///etc/passwd", "remote images are not fetched"),
    (_url(_png(3), "image/svg+xml"), "media type 'image/svg+xml'"),
    ("data:image/png;base64,@@@@", "base64 is malformed"),
    (_url(_png(4), "image/jpeg"), "the bytes are PNG, not image/jpeg"),
    (_url(_tiff()), "not an image"),  # PIL could read it; only PNG, JPEG, WebP and GIF decoders see user bytes
])
def test_bad_images_are_400s_naming_the_fault(vision_server, url, fault):
    base, model_dir = vision_server
    r = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                   json={"model": str(model_dir), "messages": _messages(url), "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fault in error["message"] and "messages[0].content[1]" in error["message"]
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"


def test_too_many_images(vision_server):
    base, model_dir = vision_server
    r = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                   json={"model": str(model_dir), "messages": _messages(*[_url(_png(i)) for i in range(3)]),
                         "max_tokens": 2})
    assert r.status_code == 400 and "more than 2 image(s)" in r.json()["error"]["message"]


def test_typed_placeholders_without_an_image_are_refused(vision_server):
    """A user who types the image tokens as text gets no image slot: the engine counts runs against images."""
    base, model_dir = vision_server
    text = "<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>"
    r = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                   json={"model": str(model_dir), "messages": [{"role": "user", "content": text}], "max_tokens": 2})
    assert r.status_code == 400 and "run(s) of image placeholders" in r.json()["error"]["message"]


def test_images_in_assistant_messages_are_refused():
    with pytest.raises(ValueError, match="images go in user messages"):
        take_images([{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": _url(_png(1))}}]}], 4)


def test_images_to_a_text_model_are_400s(server):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", headers=server.headers(), timeout=60,
                   json={"model": server.model, "messages": _messages(_url(_png(1))), "max_tokens": 2})
    assert r.status_code == 400 and "does not take images" in r.json()["error"]["message"]


def test_the_image_marker_in_text_is_refused(vision_server):
    base, model_dir = vision_server
    messages = [{"role": "user", "content": [{"type": "text", "text": "a \x00tunix-rt-image\x00 b"},
                                             {"type": "image_url", "image_url": {"url": _url(_png(1))}}]}]
    r = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                   json={"model": str(model_dir), "messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and "reserved for images" in r.json()["error"]["message"]
