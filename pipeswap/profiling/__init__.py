"""Per-layer costs of a training step: measured on a device or estimated on meta."""

from pipeswap.profiling.estimate import Efficiency, estimate, estimate_layered, meta_copy
from pipeswap.profiling.measure import measure
from pipeswap.profiling.saved import (
    SavedRecord,
    SavedTensorCapture,
    capture_saved,
    meta_attention_like_cpu,
)
from pipeswap.profiling.table import fit_warning, format_profile

__all__ = [
    "Efficiency",
    "SavedRecord",
    "SavedTensorCapture",
    "capture_saved",
    "estimate",
    "estimate_layered",
    "fit_warning",
    "format_profile",
    "measure",
    "meta_attention_like_cpu",
    "meta_copy",
]
