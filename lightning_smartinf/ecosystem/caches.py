"""Key/value cache objects of Hugging Face models, recognised without importing transformers."""

from __future__ import annotations

import sys
from typing import Any


def is_kv_cache(value: Any) -> bool:
    """Whether ``value`` is a transformers ``Cache`` (``DynamicCache``, ``StaticCache``, ...).

    HF models create one per forward unless ``use_cache=False`` and hand it to every decoder layer, which appends
    its keys and values to it."""
    module = sys.modules.get("transformers.cache_utils")
    cache = getattr(module, "Cache", None) if module is not None else None
    return cache is not None and isinstance(value, cache)
