"""Fixtures the end-to-end training tests share: tiny model directories made once per session and a per-module
scratch root."""

from __future__ import annotations

import pytest

from tests.models.hf_tiny import make_tiny_model_dir


@pytest.fixture(scope="module")
def root(tmp_path_factory, request):
    """A scratch directory for the module's runs and datasets."""
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny(tiny_models):
    """The student: a 2-layer llama, vocab 256, with the tiny tokenizer (ids < 105) and a chat template."""
    make_tiny_model_dir(tiny_models / "tiny")
    return tiny_models / "tiny"


@pytest.fixture(scope="session")
def teacher(tiny_models):
    """Another tiny llama with the same vocabulary (different weights)."""
    make_tiny_model_dir(tiny_models / "teacher", seed=1)
    return tiny_models / "teacher"
