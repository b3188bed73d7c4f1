"""The package's public names load on first use: importing the ops (or a config) stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tunix_rt


def test_importing_the_ops_loads_no_engine_loader_or_grammar_library():
    code = ("import sys, tunix_rt.ops; heavy = [m for m in ('tunix_rt.engine.engine', 'tunix_rt.checkpoints.loader', "
            "'llguidance', 'tokenizers') if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_names_resolve_lazily():
    from tunix_rt.engine.engine import Engine
    from tunix_rt.engine.params import SamplingParams

    assert tunix_rt.Engine is Engine and tunix_rt.SamplingParams is SamplingParams
    assert set(tunix_rt.__all__) <= set(dir(tunix_rt)) and callable(tunix_rt.load)
    with pytest.raises(AttributeError, match="no_such_name"):
        tunix_rt.no_such_name
