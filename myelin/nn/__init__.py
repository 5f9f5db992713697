"""Layers that are themselves a technique: the LSH-sampled wide softmax and what it needs.

`LSHSoftmax` (layer.py) trains a softmax over 10^5-10^6 classes by computing only the
classes its hash tables (tables.py over hashing.py) find for the batch; `LazyAdam`
(lazy_adam.py) updates only the rows it touched; xc_data.py makes extreme-classification
data to train it on, with no download.
"""

from myelin.nn.config import LSHConfig
from myelin.nn.hashing import Hasher
from myelin.nn.layer import LSHSoftmax, soft_target_loss, sparse_rows
from myelin.nn.lazy_adam import LazyAdam
from myelin.nn.tables import LSHTables, active_set
from myelin.nn.xc_data import XCBatch, XCConfig, XCData, XCSplit, make_xc

__all__ = [
    "Hasher",
    "LSHConfig",
    "LSHSoftmax",
    "LSHTables",
    "LazyAdam",
    "XCBatch",
    "XCConfig",
    "XCData",
    "XCSplit",
    "active_set",
    "make_xc",
    "soft_target_loss",
    "sparse_rows",
]
