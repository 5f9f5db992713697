"""The names a HuggingFace folder holds a model's tensors under, where transformers renames
them on load (GPT-NeoX saves `embed_out` for its `lm_head`): `weights=` reads such a folder
as `from_pretrained` does. Only renamings: a conversion that merges or splits tensors (MoE
experts stored one by one) is not followed, and its tensors are named as missing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from myelin.hf.shape import is_hf_model

__all__ = ["saved_renames"]


def saved_renames(model: Any) -> Callable[[str], str] | None:
    """A folder key -> the model's key, by transformers' own renaming rules for `model`;
    None for a model that is not HuggingFace's, or has no renaming rule."""
    if not is_hf_model(model):
        return None
    try:  # transformers is loaded (the model is its); older versions have no such rules
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings
    except ImportError:
        return None
    rules = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    if not rules:
        return None
    return lambda key: apply_renamings(key, rules)
