"""Images in chat messages: OpenAI's `image_url` content parts, as `data:` URLs only (a server shared by many
clients fetches nothing on their behalf), decoded with bounds, placed in the prompt as the model's processor
places them (Gemma 3: each image's run of soft-token placeholders between <start_of_image> and <end_of_image>)
and turned into pixel values for the engine."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re

import numpy as np

from tunix_rt.models.image_processor import (
    IMAGE_SENTINEL,
    ImageError,
    ImageProcessor,
    ImageTokensText,
    decode_image,
    place_sentinels,
)

MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")  # what a data: URL may carry
_DATA_URL = re.compile(r"^data:([\w.+-]+/[\w.+-]+);base64,(.*)$", re.DOTALL)


class ImageInputError(ValueError):
    """A bad image part: the message names the part and what is wrong with it (a 400)."""


@dataclasses.dataclass(frozen=True)
class ChatImages:
    """What a chat request's images become: its messages with each image part as a sentinel text part (for the
    chat template), and the images, in order."""

    messages: list[dict]
    images: list


def image_bytes(url: str, where: str) -> bytes:
    """The bytes of a `data:<image type>;base64,...` URL; ImageInputError for any other URL or a bad one."""
    m = _DATA_URL.match(url)
    if m is None:
        scheme = url.split(":", 1)[0][:16] if ":" in url else "no scheme"
        raise ImageInputError(f"{where}: only data: URLs with base64 images are accepted (got {scheme}); remote "
                              "images are not fetched")
    if m.group(1).lower() not in MEDIA_TYPES:
        raise ImageInputError(f"{where}: media type {m.group(1)!r} is not one of {', '.join(MEDIA_TYPES)}")
    try:
        return base64.b64decode(m.group(2), validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError(f"{where}: the data: URL's base64 is malformed") from None


def take_images(messages: list[dict], max_images: int) -> ChatImages:
    """Each `image_url` part decoded (in message order) and replaced by a sentinel text part."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if part.get("type") != "image_url":
                parts.append(part)
                continue
            where = f"messages[{i}].content[{j}]"
            if message.get("role") != "user":
                raise ImageInputError(f"{where}: images go in user messages, not {message.get('role')!r} ones")
            url = (part.get("image_url") or {}).get("url")
            if not isinstance(url, str):
                raise ImageInputError(f"{where}: an image_url part needs image_url.url")
            if len(images) == max_images:
                raise ImageInputError(f"{where}: more than {max_images} image(s) in one request (the server's "
                                      "limit_mm_per_prompt)")
            try:
                images.append(decode_image(image_bytes(url, where)))
            except ImageError as e:
                raise ImageInputError(f"{where}: {e}") from None
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
