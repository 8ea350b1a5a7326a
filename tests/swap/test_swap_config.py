"""SwapConfig: every swap setting checked once, each refusal naming the field it is about.

Covers: pipeswap/swap/swap_config.py.
"""

from __future__ import annotations

import pytest

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.hardware.presets import preset
from pipeswap.swap.plan.planner import make_case, make_plan
from pipeswap.swap.swap_config import DEFAULT_BUCKET_BYTES, POLICY_NAMES, SwapConfig


def test_defaults() -> None:
    config = SwapConfig()
    assert (config.policy, config.time_limit_s) == ("auto", 60.0)
    assert config.bucket_bytes == DEFAULT_BUCKET_BYTES == 25 * 2**20
    assert config.gpu_memory_bytes is None and config.footprint_ratio is None
    assert "auto" in POLICY_NAMES and "none" in POLICY_NAMES


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"policy": "greedy"}, "policy 'greedy' is not a swap policy; use one of none, "),
        ({"gpu_memory_bytes": 10**9, "footprint_ratio": 1.5}, "give gpu_memory_bytes or "),
        ({"footprint_ratio": 0.5}, "footprint_ratio is 0.5; use a ratio >= 1"),
        ({"footprint_ratio": float("nan")}, "footprint_ratio is nan; use a ratio >= 1"),
        ({"footprint_ratio": float("inf")}, "footprint_ratio is inf; use a ratio >= 1"),
        ({"time_limit_s": 0.0}, "time_limit_s is 0.0; use a positive finite"),
        ({"time_limit_s": float("inf")}, "time_limit_s is inf; use a positive finite"),
        ({"bucket_bytes": 0}, "bucket_bytes is 0 bytes; use a positive size"),
    ],
)
def test_each_check_names_its_field(make_profile, settings, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        SwapConfig(**settings)
    # The planner's keyword arguments are the same fields, checked by the same config.
    profile = make_profile([(1,)] * 2)
    with pytest.raises(PipeswapError, match=message.replace("(", r"\(")):
        make_plan(profile, preset("switch-4"), **settings)


def test_a_config_or_its_fields_not_both(make_profile) -> None:
    profile = make_profile([(1,)] * 2)
    config = SwapConfig(policy="none", footprint_ratio=1.0)
    case = make_case(profile, preset("switch-4"), config, gpus=2)
    assert case.gpus == ("gpu0", "gpu1") and case.sync_every == 1
    with pytest.raises(TypeError, match="not both"):
        make_plan(profile, preset("switch-4"), config, policy="none")
