"""Fixtures of the live vLLM tier live in ``vllm_live_support`` (importable by the tests too)."""

import pathlib
import sys

_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from vllm_live_support import (  # noqa: E402,F401
    models,
    proxy,
    pytest_collection_modifyitems,
    pytest_terminal_summary,
    vllm_python,
    vllm_server,
)
