"""Fixtures shared by the test layers."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight 2-layer llama MLX folder with the real tokenizer (see tests/tiny_model)."""
    from tests.e2e.helpers import model_cache_dir
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", model_cache_dir())
