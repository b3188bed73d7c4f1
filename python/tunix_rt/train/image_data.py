"""TRL's vision rows for a model with an image encoder: `messages` whose contents are lists of parts, an
`{"type": "image"}` part where each image goes, and an `images` column (file paths, relative to the dataset's
directory or absolute; `data:` URLs; or bare base64), in order. Each image is placed in the rendered
conversation as the model's processor places it (models/image_processor.py) and its pixel values ride with the
example."""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tunix_rt.models.config import VisionConfig
from tunix_rt.models.image_processor import (
    IMAGE_SENTINEL,
    ImageError,
    ImageProcessor,
    ImageTokensText,
    data_url_bytes,
    decode_image,
    place_sentinels,
)
from tunix_rt.models.vision import image_spans

MAX_IMAGE_FILE_BYTES = 64 << 20  # an image file larger than this is refused


class ImageDataError(ValueError):
    """A vision row that cannot be used (data.DataError re-raises it with the row's FILE:LINE)."""


@dataclasses.dataclass(frozen=True)
class VisionRows:
    """What turns a row's images into placeholders and pixel values."""

    processor: ImageProcessor
    text: ImageTokensText
    image_token_id: int
    base_dir: Path

    @classmethod
    def for_model(cls, vision: VisionConfig, tokenizer, model_dir, dataset) -> "VisionRows":
        directory = Path(model_dir) if model_dir is not None and Path(model_dir).is_dir() else None
        return cls(ImageProcessor.for_model(vision, directory), ImageTokensText.of(tokenizer, vision),
                   vision.image_token_id, Path(dataset).resolve().parent)


@dataclasses.dataclass(frozen=True)
class PreparedMessages:
    """A row's messages with string contents (an image part as IMAGE_SENTINEL), the function that puts each
    image's placeholder sequence in a render of them (or of their first turns), and the images' pixel values
    (one array per run of placeholders: an image, then its crops), None without images."""

    messages: list
    expand: Callable[[str], str]
    pixel_values: np.ndarray | None


def prepare(row: dict, vision: VisionRows | None) -> PreparedMessages:
    """The row's messages as the chat template takes them, with its images (see the module docstring)."""
    messages = row["messages"]
    images = row.get("images")
    parts = isinstance(messages, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                                for m in messages)
    if not parts and images is None:
        return PreparedMessages(messages, _identity, None)
    flat, slots = [], 0
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            flat.append(message)
            continue
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                if IMAGE_SENTINEL in part["text"]:
                    raise ImageDataError(f"messages[{i}].content[{j}]: the text holds a NUL-delimited marker "
                                         "reserved for images")
                texts.append(part["text"])
            elif kind == "image":
                texts.append(IMAGE_SENTINEL)
                slots += 1
            else:
                raise ImageDataError(f"messages[{i}].content[{j}] must be a text part {{\"type\": \"text\", "
                                     f"\"text\": ...}} or an image part {{\"type\": \"image\"}}, got {part!r:.80}")
        flat.append({**message, "content": "".join(texts)})
    images = [] if images is None else images
    if not isinstance(images, list):
        raise ImageDataError(f'field "images" must be a list, got {type(images).__name__}')
    if slots != len(images):
        raise ImageDataError(f'the messages hold {slots} image part(s) and field "images" {len(images)} image(s)')
    if not images:
        return PreparedMessages(flat, _identity, None)
    if vision is None:
        raise ImageDataError("the row has images, and the model has no vision encoder")
    decoded = [load_image(item, vision.base_dir, f"images[{k}]") for k, item in enumerate(images)]
    pixels, crops = vision.processor.pixel_values(decoded)
    sequences = [vision.text.with_crops(c) for c in crops]

    def expand(text: str) -> str:  # a render of the first turns holds the first images' sentinels
        return place_sentinels(text, sequences[:text.count(IMAGE_SENTINEL)])

    return PreparedMessages(flat, expand, pixels)


def _identity(text: str) -> str:
    return text


def load_image(item, base_dir: Path, where: str):
    """An `images` entry (a path, a data: URL or bare base64) as an RGB PIL image."""
    if not isinstance(item, str) or not item:
        raise ImageDataError(f"{where} must be a file path, a data: URL or base64 text, got {item!r:.60}")
    media_type = None
    try:
        if item.startswith("data:"):
            data, media_type = data_url_bytes(item, where)
        elif len(item) < 4096 and (base_dir / Path(item).expanduser()).is_file():
            path = base_dir / Path(item).expanduser()  # an absolute path stays itself
            if path.stat().st_size > MAX_IMAGE_FILE_BYTES:
                raise ImageDataError(f"{where}: {path} is larger than {MAX_IMAGE_FILE_BYTES} bytes")
            data = path.read_bytes()
        else:
            data = base64.b64decode(item, validate=True)
    except ImageError as e:
        raise ImageDataError(str(e)) from None
    except (binascii.Error, ValueError):
        raise ImageDataError(f"{where}: {item!r:.60} is neither an existing file nor base64") from None
    except OSError as e:
        raise ImageDataError(f"{where}: cannot read {item!r:.80}: {e.strerror or e}") from None
    try:
        return decode_image(data, media_type=media_type)
    except ImageError as e:
        raise ImageDataError(f"{where}: {e}") from None


def cut(ids: list[int], mask: np.ndarray, pixels: np.ndarray | None, image_token_id: int, max_length: int
        ) -> tuple[list[int], np.ndarray, np.ndarray | None]:
    """The first max_length tokens, cut before an image whose placeholders would not fit whole (the images past
    the cut are dropped with them)."""
    if pixels is None or len(ids) <= max_length:
        return ids[:max_length], mask[:max_length], pixels
    end = max_length
    if ids[end] == image_token_id:  # the cut falls inside a run: the example ends before it
        while end and ids[end - 1] == image_token_id:
            end -= 1
    runs = sum(1 for i in range(end) if ids[i] == image_token_id and (i == 0 or ids[i - 1] != image_token_id))
    return ids[:end], mask[:end], (pixels[:runs] if runs else None)


def check_placeholders(ids, pixels: np.ndarray | None, vision: VisionRows | None) -> None:
    """The tokens' runs of image placeholders must be the images' own (one whole run per image): placeholder
    tokens typed in a row's text would take the soft tokens of the images after them in a batch."""
    if vision is None:
        return
    spans = image_spans(list(ids), vision.image_token_id)
    images = 0 if pixels is None else len(pixels)
    if len(spans) != images or any(end - start != vision.text.count for start, end in spans):
        raise ImageDataError(f"the tokens hold {len(spans)} run(s) of image placeholders for {images} image(s): "
                             "the text must not contain the image tokens")
