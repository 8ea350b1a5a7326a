"""The Profile contract (pipeswap.profile/1): per-layer costs of one training step."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from pipeswap.errors import PipeswapError
from pipeswap.jsonio import check_format, dump_json, load_json

PROFILE_FORMAT = "pipeswap.profile/1"


@dataclass(frozen=True)
class SavedTensor:
    """One tensor autograd keeps for a layer's backward (parameters excluded)."""

    index: int
    bytes: int


@dataclass(frozen=True)
class LayerProfile:
    """Costs of one layer (block) of a LayeredModel, for one batch."""

    name: str
    forward_s: float
    backward_s: float
    param_bytes: int
    output_bytes: int
    saved: tuple[SavedTensor, ...] = ()
    # Transient memory the layer needs while it runs, beyond its output and saved tensors.
    workspace_bytes: int = 0
    forward_flops: int = 0
    backward_flops: int = 0

    @property
    def saved_bytes(self) -> int:
        return sum(t.bytes for t in self.saved)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "param_bytes": self.param_bytes,
            "output_bytes": self.output_bytes,
            "saved": [{"index": t.index, "bytes": t.bytes} for t in self.saved],
            "workspace_bytes": self.workspace_bytes,
            "forward_flops": self.forward_flops,
            "backward_flops": self.backward_flops,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> LayerProfile:
        return cls(
            name=str(obj["name"]),
            forward_s=float(obj["forward_s"]),
            backward_s=float(obj["backward_s"]),
            param_bytes=int(obj["param_bytes"]),
            output_bytes=int(obj["output_bytes"]),
            saved=tuple(
                SavedTensor(index=int(t["index"]), bytes=int(t["bytes"]))
                for t in obj.get("saved", [])
            ),
            workspace_bytes=int(obj.get("workspace_bytes", 0)),
            forward_flops=int(obj.get("forward_flops", 0)),
            backward_flops=int(obj.get("backward_flops", 0)),
        )


@dataclass(frozen=True)
class Profile:
    """Measured or estimated per-layer costs of one model at one batch size.

    ``layers`` are in forward order. ``source`` is ``"measured"`` or ``"estimate"``;
    ``device`` is ``"cpu"``/``"cuda"`` for measured profiles and the GPU spec name for
    estimates. ``notes`` records assumptions (e.g. the efficiency per op class used).
    """

    model: str
    batch: int
    dtype: str
    source: str
    device: str
    optimizer: str
    optimizer_state_bytes: int
    layers: tuple[LayerProfile, ...]
    seq_len: int | None = None
    image_size: int | None = None
    has_saved_data: bool = True
    notes: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    # ---- totals -------------------------------------------------------------------
    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def saved_bytes(self) -> int:
        return sum(layer.saved_bytes for layer in self.layers)

    @property
    def forward_s(self) -> float:
        return sum(layer.forward_s for layer in self.layers)

    @property
    def backward_s(self) -> float:
        return sum(layer.backward_s for layer in self.layers)

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def resident_bytes(self) -> int:
        """Memory that never moves: parameters, their gradients and optimizer state."""
        return 2 * self.param_bytes + self.optimizer_state_bytes

    def peak_training_bytes(self) -> int:
        """Peak device memory of one training step with nothing swapped.

        Resident state plus every saved tensor (all alive at the forward/backward turn)
        plus the largest transient working set of one layer.
        """
        largest_transient = max(
            (layer.workspace_bytes + layer.output_bytes for layer in self.layers), default=0
        )
        return self.resident_bytes + self.saved_bytes + largest_transient

    def layer(self, name: str) -> LayerProfile:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise PipeswapError(f"profile of {self.model} has no layer {name!r}")

    # ---- JSON ---------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "format": PROFILE_FORMAT,
            "model": self.model,
            "batch": self.batch,
        }
        if self.seq_len is not None:
            obj["seq_len"] = self.seq_len
        if self.image_size is not None:
            obj["image_size"] = self.image_size
        obj.update(
            {
                "dtype": self.dtype,
                "source": self.source,
                "device": self.device,
                "optimizer": self.optimizer,
                "optimizer_state_bytes": self.optimizer_state_bytes,
                "has_saved_data": self.has_saved_data,
                "totals": {
                    "param_bytes": self.param_bytes,
                    "saved_bytes": self.saved_bytes,
                    "forward_s": self.forward_s,
                    "backward_s": self.backward_s,
                    "peak_training_bytes": self.peak_training_bytes(),
                },
                "notes": self.notes,
                "layers": [layer.to_json() for layer in self.layers],
            }
        )
        return obj

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "profile") -> Profile:
        check_format(obj, PROFILE_FORMAT, where)
        try:
            layers = tuple(LayerProfile.from_json(layer) for layer in obj["layers"])
            has_saved = bool(obj.get("has_saved_data", all("saved" in la for la in obj["layers"])))
            return cls(
                model=str(obj["model"]),
                batch=int(obj["batch"]),
                dtype=str(obj.get("dtype", "float32")),
                source=str(obj.get("source", "measured")),
                device=str(obj.get("device", "cpu")),
                optimizer=str(obj.get("optimizer", "sgd")),
                optimizer_state_bytes=int(obj.get("optimizer_state_bytes", 0)),
                layers=layers,
                seq_len=None if obj.get("seq_len") is None else int(obj["seq_len"]),
                image_size=None if obj.get("image_size") is None else int(obj["image_size"]),
                has_saved_data=has_saved,
                notes=dict(obj.get("notes", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PipeswapError(f"{where}: malformed profile ({exc!r})") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        dump_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        return cls.from_json(load_json(path), where=str(path))
