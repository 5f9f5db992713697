"""HuggingFace tests need transformers (the dev extra installs it); quiet its logging."""

import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))  # hf_families, shared
