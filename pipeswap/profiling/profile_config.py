"""ProfileConfig: where a profile comes from (measured here, or estimated for a GPU spec)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeswap.config_fields import option, require

__all__ = ["DEFAULT_GPU", "ProfileConfig"]

DEFAULT_GPU = "v100-32gb"


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """How a profile is made: ``estimate`` on the meta device for the GPU spec ``gpu``
    (``estimate`` names the model, or is ``""`` for the run's own model), or measured
    here: ``warmup`` untimed steps, then ``repeats`` timed ones (their median kept), with
    the saved tensors on the host when ``saved_on_host``.
    What is profiled (model, batch, shape, device, precision) is the run's
    (:class:`pipeswap.train_config.TrainConfig`'s fields)."""

    estimate: str | None = option(
        None,
        metavar="MODEL",
        const="",
        help="estimate the profile on the meta device for {gpu} instead of measuring (or "
        "reading) one: of MODEL, or of {model} when MODEL is left out",
    )
    gpu: str | None = option(
        None, help=f"GPU spec to estimate for, with {{estimate}} (default {DEFAULT_GPU})"
    )
    warmup: int = option(1, help="untimed steps (measure only)")
    repeats: int = option(3, help="timed steps; median reported")
    saved_on_host: bool = option(
        False,
        help="measure with every saved tensor in host memory, within the memory of a plan "
        "that swaps them all: for a batch whose step does not fit as it is (the profile "
        "is the same; measure only)",
    )

    def __post_init__(self) -> None:
        require(self.repeats >= 1, f"{{repeats}} is {self.repeats}; use a whole number >= 1")
        require(self.warmup >= 0, f"{{warmup}} is {self.warmup}; use a whole number >= 0")
