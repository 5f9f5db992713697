"""HuggingFace causal LMs as pipelines: found by their structure, run by their own forward,
trained on HF's own loss. Nothing here imports transformers: a model is HuggingFace's when
transformers is loaded and its `PreTrainedModel` says so."""

from myelin.hf.keys import saved_renames
from myelin.hf.loss import CausalLMLoss, labelled, own_loss
from myelin.hf.shape import BY_HAND, Found, find, is_hf_model
from myelin.hf.stage import INPUTS, Ends, HFStage, layers_of

__all__ = [
    "BY_HAND",
    "INPUTS",
    "CausalLMLoss",
    "Ends",
    "Found",
    "HFStage",
    "find",
    "is_hf_model",
    "labelled",
    "layers_of",
    "own_loss",
    "saved_renames",
]
