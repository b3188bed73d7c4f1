"""Images in chat messages: OpenAI's `image_url` content parts, as `data:` URLs only (a server shared by many
clients fetches nothing on their behalf), decoded with bounds, placed in the prompt as the model's processor
places them (Gemma 3: each image's run of soft-token placeholders between <start_of_image> and <end_of_image>)
and turned into pixel values for the engine."""

from __future__ import annotations

import dataclasses

import numpy as np

from tunix_rt.models.image_processor import (
    IMAGE_SENTINEL,
    ImageError,
    ImageProcessor,
    ImageTokensText,
    data_url_bytes,
    decode_image,
    place_sentinels,
)


class ImageInputError(ValueError):
    """A bad image part: the message names the part and what is wrong with it (a 400)."""


@dataclasses.dataclass(frozen=True)
class ChatImages:
    """What a chat request's images become: its messages with each image part as a sentinel text part (for the
    chat template), and the images, in order."""

    messages: list[dict]
    images: list


def take_images(messages: list[dict], max_images: int, *, model: str | None = None) -> ChatImages:
    """Each `image_url` part decoded (in message order) and replaced by a sentinel text part; `model`: the name of
    a model that takes no images (an image part is then refused before anything is decoded)."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if IMAGE_SENTINEL in (part.get("text") or ""):
                raise ImageInputError(f"{where}: the text holds a NUL-delimited marker reserved for images")
            if part.get("type") != "image_url":
                parts.append(part)
                continue
            if model is not None:
                raise ImageInputError(f"{where}: {model} does not take images")
            if message.get("role") != "user":
                raise ImageInputError(f"{where}: images go in user messages, not {message.get('role')!r} ones")
            url = (part.get("image_url") or {}).get("url")
            if not isinstance(url, str):
                raise ImageInputError(f"{where}: an image_url part needs image_url.url")
            if len(images) == max_images:
                raise ImageInputError(f"{where}: more than {max_images} image(s) in one request (the server's "
                                      "limit_mm_per_prompt)")
            try:
                data, media_type = data_url_bytes(url, where)
                images.append(decode_image(data, media_type=media_type))
            except ImageError as e:
                raise ImageInputError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
            parts.append({"type": "text", "text": IMAGE_SENTINEL})
        out.append({**message, "content": parts})
    return ChatImages(out, images)


def place_images(prompt: str, chat: ChatImages, processor: ImageProcessor, text: ImageTokensText
                 ) -> tuple[str, list[np.ndarray]]:
    """The rendered prompt with each image's sentinel replaced by its placeholder sequence (its crops' too), and
    the pixel values of every image and crop in the prompt's order."""
    pixels, crops = processor.pixel_values(chat.images) if chat.images else (np.zeros((0,)), [])
    try:
        placed = place_sentinels(prompt, [text.with_crops(c) for c in crops])
    except ValueError as e:
        raise ImageInputError(f"messages: {e}") from None
    return placed, list(pixels)
