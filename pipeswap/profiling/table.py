"""A Profile as a readable table: per-layer time and memory, totals, and the training peak."""

from __future__ import annotations

from pipeswap.hardware.gpus import GpuSpec
from pipeswap.profiling.profile import Profile

__all__ = ["fit_warning", "format_profile"]

_MiB = 2**20
_GiB = 2**30
_HEADER = ("layer", "fwd ms", "bwd ms", "params MiB", "saved MiB", "output MiB")


def _row(name: str, fwd_s: float, bwd_s: float, params: int, saved: int, output: int) -> list[str]:
    return [
        name,
        f"{fwd_s * 1e3:.3f}",
        f"{bwd_s * 1e3:.3f}",
        f"{params / _MiB:.2f}",
        f"{saved / _MiB:.2f}",
        f"{output / _MiB:.2f}",
    ]


def _title(profile: Profile) -> str:
    shape = []
    if profile.seq_len is not None:
        shape.append(f"seq_len {profile.seq_len}")
    if profile.image_size is not None:
        shape.append(f"image_size {profile.image_size}")
    how = "measured on" if profile.source == "measured" else "estimated for"
    return ", ".join(
        [
            f"{profile.model}",
            f"batch {profile.batch}",
            *shape,
            profile.dtype,
            f"{how} {profile.device}",
            f"optimizer {profile.optimizer}",
        ]
    )


def fit_warning(profile: Profile, spec: GpuSpec) -> str | None:
    """A warning line when one training step's peak exceeds ``spec``'s memory, else None."""
    needed = profile.peak_training_bytes()
    if needed <= spec.memory_bytes:
        return None
    return (
        f"warning: one training step of {profile.model} at batch {profile.batch} needs "
        f"{needed / _GiB:.2f} GiB but a {spec.name} has {spec.memory_bytes / _GiB:.2f} GiB; "
        f"it does not fit without swapping or pipelining"
    )


def format_profile(profile: Profile, spec: GpuSpec | None = None) -> str:
    """The table ``pipeswap profile`` prints; with ``spec``, whether the peak fits it."""
    rows = [list(_HEADER)]
    for layer in profile.layers:
        rows.append(
            _row(
                layer.name,
                layer.forward_s,
                layer.backward_s,
                layer.param_bytes,
                layer.saved_bytes,
                layer.output_bytes,
            )
        )
    rows.append(
        _row(
            "total",
            profile.forward_s,
            profile.backward_s,
            profile.param_bytes,
            profile.saved_bytes,
            sum(layer.output_bytes for layer in profile.layers),
        )
    )
    widths = [max(len(row[col]) for row in rows) for col in range(len(_HEADER))]

    def line(row: list[str]) -> str:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        return "  ".join(cells)

    rule = "-" * len(line(rows[0]))
    out = [_title(profile), line(rows[0]), rule, *(line(r) for r in rows[1:-1]), rule]
    out.append(line(rows[-1]))
    peak = profile.peak_training_bytes()
    out.append(
        f"resident (parameters, gradients, {profile.optimizer} state): "
        f"{profile.resident_bytes / _MiB:.2f} MiB"
    )
    out.append(
        f"peak memory of one training step (resident + saved + largest layer transient): "
        f"{peak / _MiB:.2f} MiB ({peak / _GiB:.3f} GiB)"
    )
    if spec is not None:
        verdict = "fits" if peak <= spec.memory_bytes else "does NOT fit"
        out.append(
            f"GPU {spec.name}: {spec.memory_bytes / _GiB:.2f} GiB memory; the step {verdict}"
        )
    return "\n".join(out)
