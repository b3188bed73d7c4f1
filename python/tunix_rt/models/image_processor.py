"""Images into Gemma 3's pixel values, as HF's Gemma3 image processor (its PIL backend) makes them: RGB,
resized bilinearly to the tower's square, scaled by 1/255, normalised per channel; optionally pan-and-scan
crops of an elongated image after the image itself. Bytes from users are decoded with bounds (`decode_image`)."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import itertools
import json
import math
import re
from pathlib import Path

import numpy as np

from tunix_rt.models.config import VisionConfig

_DATA_URL = re.compile(r"^data:([\w.+-]+/[\w.+-]+);base64,(.*)$", re.DOTALL)
IMAGE_SENTINEL = "\x00tunix-rt-image\x00"  # stands for an image while a chat template renders the messages
MAX_IMAGE_PIXELS = 24 * 1024 * 1024  # a decoded image larger than this is refused (the tower reads 896 x 896)
FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}  # all PIL may open


class ImageError(ValueError):
    """An image that cannot be used: not an image, truncated, too large, or of an unsupported mode."""


def decode_image(data: bytes, *, media_type: str | None = None, max_pixels: int = MAX_IMAGE_PIXELS):
    """PNG, JPEG, WebP or GIF bytes (only those: PIL's other decoders never see user bytes) -> an RGB PIL image,
    fully decoded; with `media_type` the bytes must be of that type. ImageError naming what is wrong otherwise."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=list(FORMATS.values())) as probe:
            if media_type is not None and probe.format != FORMATS.get(media_type):
                raise ImageError(f"the bytes are {probe.format}, not {media_type}")
            width, height = probe.size
            if width < 1 or height < 1 or width * height > max_pixels:
                raise ImageError(f"image of {width}x{height} pixels is outside 1..{max_pixels} pixels")
            probe.load()  # decodes now: a truncated file fails here, not later
            return _rgb(probe)
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError("not an image (PIL cannot identify the bytes as PNG, JPEG, WebP or GIF)") from None
    except Exception as e:  # noqa: BLE001 - whatever a decoder raises on hostile bytes is this image's fault
        raise ImageError(f"image cannot be decoded: {type(e).__name__}: {e}") from None


def data_url_bytes(url: str, where: str) -> tuple[bytes, str]:
    """The bytes and media type of a `data:<image type>;base64,...` URL; ImageError for anything else."""
    m = _DATA_URL.match(url)
    if m is None:
        scheme = url.split(":", 1)[0][:16] if ":" in url else "no scheme"
        raise ImageError(f"{where}: only data: URLs with base64 images are accepted (got {scheme}); remote images "
                         "are not fetched")
    media_type = m.group(1).lower()
    if media_type not in FORMATS:
        raise ImageError(f"{where}: media type {m.group(1)!r} is not one of {', '.join(FORMATS)}")
    try:
        return base64.b64decode(m.group(2), validate=True), media_type
    except (binascii.Error, ValueError):
        raise ImageError(f"{where}: the data: URL's base64 is malformed") from None


def _rgb(image):
    """HF's convert_to_rgb: an image with alpha or a transparent colour composited over white, others converted."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB") if image.mode != "RGB" else image.copy()


@dataclasses.dataclass(frozen=True)
class ImageProcessor:
    """HF's Gemma3ImageProcessor settings (preprocessor_config.json's names)."""

    size: int
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = 2  # PIL's BILINEAR
    do_pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio_to_activate: float = 1.2

    @classmethod
    def for_model(cls, vision: VisionConfig, model_dir: str | Path | None = None) -> "ImageProcessor":
        """The checkpoint's preprocessor_config.json where it has one, else HF's defaults at the tower's size."""
        path = None if model_dir is None else Path(model_dir) / "preprocessor_config.json"
        if path is None or not path.is_file():
            return cls(size=vision.image_size)
        d = json.loads(path.read_text())
        size = d.get("size") or {}
        height, width = size.get("height", vision.image_size), size.get("width", vision.image_size)
        if height != width or height != vision.image_size:
            raise ValueError(f"{path}: size {height}x{width} is not the vision tower's {vision.image_size}x"
                             f"{vision.image_size}")
        keys = {f.name for f in dataclasses.fields(cls)} - {"size"}
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in keys and v is not None}
        return cls(size=height, **kw)

    def crops(self, image) -> list:
        """The image's pan-and-scan crops (HF's rule: 2..max crops along the long side when its aspect ratio
        reaches min_ratio_to_activate and each crop keeps min_crop_size); [] when off or not worth it."""
        if not self.do_pan_and_scan:
            return []
        width, height = image.size
        long, short = (width, height) if width >= height else (height, width)
        if long / short < self.pan_and_scan_min_ratio_to_activate:
            return []
        n = min(int(math.floor(long / short + 0.5)), int(math.floor(long / self.pan_and_scan_min_crop_size)))
        n = min(self.pan_and_scan_max_num_crops, max(2, n))
        across, down = (n, 1) if width >= height else (1, n)
        crop_w, crop_h = int(math.ceil(width / across)), int(math.ceil(height / down))
        if min(crop_w, crop_h) < self.pan_and_scan_min_crop_size:
            return []
        return [image.crop((x, y, min(x + crop_w, width), min(y + crop_h, height)))
                for y, x in itertools.product(range(0, crop_h * down, crop_h), range(0, crop_w * across, crop_w))]

    def pixel_values(self, images) -> tuple[np.ndarray, list[int]]:
        """RGB PIL images -> (pixel values (N, 3, size, size) f32 of each image followed by its crops, crops per
        image)."""
        out, num_crops = [], []
        for image in images:
            crops = self.crops(image)
            num_crops.append(len(crops))
            out.extend(self._normalise(im) for im in [image, *crops])
        return np.stack(out).astype(np.float32), num_crops

    def _normalise(self, image) -> np.ndarray:
        resized = np.asarray(image.resize((self.size, self.size), resample=self.resample)).transpose(2, 0, 1)
        scaled = (resized.astype(np.float64) * self.rescale_factor).astype(np.float32)
        mean = np.asarray(self.image_mean, np.float32)[:, None, None]
        std = np.asarray(self.image_std, np.float32)[:, None, None]
        return (scaled - mean) / std


@dataclasses.dataclass(frozen=True)
class ImageTokensText:
    """The token strings of a Gemma 3 processor's image sequence."""

    begin: str  # <start_of_image>
    soft: str  # <image_soft_token>, mm_tokens_per_image times
    end: str  # <end_of_image>
    count: int

    def sequence(self) -> str:
        return f"\n\n{self.begin}{self.soft * self.count}{self.end}\n\n"

    def with_crops(self, crops: int) -> str:
        """An image and its pan-and-scan crops, as HF's Gemma3Processor writes them."""
        if not crops:
            return self.sequence()
        return (f"Here is the original image {self.sequence()} and here are some crops to help you see better "
                + " ".join([self.sequence()] * crops))


    @classmethod
    def of(cls, tokenizer, vision: VisionConfig) -> "ImageTokensText":
        """The model's image token strings from its tokenizer; ValueError when the tokenizer lacks one."""
        ids = (vision.boi_token_id, vision.image_token_id, vision.eoi_token_id)
        texts = [tokenizer.backend.id_to_token(i) for i in ids]
        if None in texts:
            raise ValueError(f"the tokenizer has no token for the image token id(s) "
                             f"{[i for i, t in zip(ids, texts) if t is None]}")
        return cls(*texts, vision.mm_tokens_per_image)


def place_sentinels(text: str, sequences: list[str]) -> str:
    """`text` with its IMAGE_SENTINELs replaced by `sequences`, in order; ValueError when the counts differ (a
    chat template that dropped or repeated a message's content)."""
    pieces = text.split(IMAGE_SENTINEL)
    if len(pieces) != len(sequences) + 1:
        raise ValueError(f"the chat template kept {len(pieces) - 1} of the {len(sequences)} image(s)")
    return pieces[0] + "".join(seq + piece for seq, piece in zip(sequences, pieces[1:]))
