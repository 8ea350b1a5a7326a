"""Small profiles and schedules the layout tests share."""

from __future__ import annotations

import dataclasses

from support import GB, toy_profile

from pipeswap.profiling.profile import Profile


def toy(
    layers: int = 8,
    saved_gb: float = 1.0,
    output_gb: float = 0.0,
    step_s: float = 0.5,
    param_bytes: int = GB // 100,
) -> Profile:
    """``layers`` equal layers (1 s forward, 2 s backward, ``saved_gb`` saved and
    ``param_bytes`` of parameters each), with a timed optimizer step of ``step_s``."""
    profile = toy_profile([(saved_gb,)] * layers, output_gb=output_gb, param_bytes=param_bytes)
    return dataclasses.replace(profile, optimizer_step_s=step_s)


__all__ = ["GB", "toy"]
