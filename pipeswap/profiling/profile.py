"""The Profile contract (pipeswap.profile/1): per-layer costs of one training step."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from pipeswap import json_fields as fields
from pipeswap.errors import PipeswapError
from pipeswap.jsonio import check_format, dump_json, load_json
from pipeswap.step_memory import StepMemory

__all__ = ["PROFILE_FORMAT", "LayerProfile", "Profile", "SavedTensor", "StepMemory"]

PROFILE_FORMAT = "pipeswap.profile/1"


@dataclass(frozen=True)
class SavedTensor:
    """One saved tensor of a layer as the profile keeps it: its saved index and its bytes.

    A saved tensor is a storage autograd keeps for the layer's backward (parameters
    excluded), named (layer, index) from the profiler through the plan to the executor."""

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
    # Measured recomputation (None: the planner's rule, the previous layer's output): what
    # the layer still holds through the step when it is recomputed (its input, kept by the
    # wrapper, and what ops after it save), and what its re-run saves anew.
    kept_bytes: int | None = None
    rerun_bytes: int | None = None
    # What the re-run holds for the layer's output beyond that and the forward's working
    # set: the output's gradient, which its backward starts with (capture.InnerSaves).
    rerun_output_bytes: int | None = None
    # Measured selective recomputation (pipeswap.swap.runtime.selective; None: not
    # measured): what the layer keeps (its input and the outputs dear to compute), what
    # its re-run saves anew, and how long the re-run takes.
    selective_kept_bytes: int | None = None
    selective_rerun_bytes: int | None = None
    selective_rerun_s: float | None = None
    # The attributes of its modules its forward leaves holding a tensor that carries the
    # graph (comma separated; pipeswap.swap.runtime.held_state): never recomputed.
    held_state: str | None = None

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
            **{key: value for key in _OPTIONAL if (value := getattr(self, key)) is not None},
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "layer") -> LayerProfile:
        """One layer, each field checked: times finite and >= 0, byte counts whole and >= 0.

        Unchecked, a NaN time reached the partitioner and a negative ``param_bytes`` was
        blamed on the topology's memory much later; ``where`` names the file and layer.
        """
        obj = fields.as_object(obj, where)
        name = fields.text_field(obj, "name", where)
        where = f"{where} ({name!r})"
        saved = fields.list_field(obj, "saved", where, default=[])
        indices = [t.get("index") if isinstance(t, dict) else None for t in saved]
        twice = sorted({i for i in indices if indices.count(i) > 1 and i is not None})
        if twice:
            raise PipeswapError(
                f"{where}: saved index {twice[0]} appears twice; give each saved tensor of a "
                "layer its own index (0, 1, ...), or profile again (pipeswap profile)"
            )
        return cls(
            name=name,
            forward_s=fields.seconds_field(obj, "forward_s", where),
            backward_s=fields.seconds_field(obj, "backward_s", where),
            param_bytes=fields.count_field(obj, "param_bytes", where),
            output_bytes=fields.count_field(obj, "output_bytes", where),
            saved=tuple(
                SavedTensor(
                    index=fields.count_field(
                        fields.as_object(t, f"{where} saved[{k}]"), "index", f"{where} saved[{k}]"
                    ),
                    bytes=fields.count_field(t, "bytes", f"{where} saved[{k}]"),
                )
                for k, t in enumerate(saved)
            ),
            workspace_bytes=fields.count_field(obj, "workspace_bytes", where, default=0),
            forward_flops=fields.count_field(obj, "forward_flops", where, default=0),
            backward_flops=fields.count_field(obj, "backward_flops", where, default=0),
            kept_bytes=_optional(obj, "kept_bytes", where, fields.count_field),
            rerun_bytes=_optional(obj, "rerun_bytes", where, fields.count_field),
            rerun_output_bytes=_optional(obj, "rerun_output_bytes", where, fields.count_field),
            selective_kept_bytes=_optional(obj, "selective_kept_bytes", where, fields.count_field),
            selective_rerun_bytes=_optional(
                obj, "selective_rerun_bytes", where, fields.count_field
            ),
            selective_rerun_s=_optional(obj, "selective_rerun_s", where, fields.seconds_field),
            held_state=_optional(obj, "held_state", where, fields.text_field),
        )


# LayerProfile's measured fields, written only when measured.
_OPTIONAL = (
    "kept_bytes",
    "rerun_bytes",
    "rerun_output_bytes",
    "selective_kept_bytes",
    "selective_rerun_bytes",
    "selective_rerun_s",
    "held_state",
)


def _optional(obj: dict[str, Any], key: str, where: str, parse: Any) -> Any:
    return None if obj.get(key) is None else parse(obj, key, where)


@dataclass(frozen=True)
class Profile:
    """Measured or estimated per-layer costs of one model at one batch size.

    ``layers`` are in forward order. ``source`` is ``"measured"`` or ``"estimate"``;
    ``device`` is ``"cpu"``/``"cuda"`` for measured profiles and the GPU spec name for
    estimates. ``optimizer_step_s`` is one optimizer step over every parameter as timed
    (None: not measured; planners then estimate it from the GPU's memory bandwidth).
    ``notes`` records assumptions (e.g. the efficiency per op class used). ``memory``
    (optional) is what a meter read during one real step (:class:`StepMemory`); planners
    then count what the device really held, not only the saved tensors.
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
    optimizer_step_s: float | None = None
    notes: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    memory: StepMemory | None = None

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

        Measured (``memory``): the most the meter read. Otherwise the model: resident state
        plus every saved tensor (all alive at the forward/backward turn) plus the largest
        transient working set of one layer.
        """
        if self.memory is not None:
            return self.memory.peak_bytes
        largest_transient = max(
            (layer.workspace_bytes + layer.output_bytes for layer in self.layers), default=0
        )
        return self.resident_bytes + self.saved_bytes + largest_transient

    def slowed(self, factor: float, why: str) -> Profile:
        """This profile with every layer's compute ``factor`` times slower (ranks that share
        a machine's cores, as calibrated), saying ``why`` in its notes."""
        layers = tuple(
            replace(layer, forward_s=layer.forward_s * factor, backward_s=layer.backward_s * factor)
            for layer in self.layers
        )
        step = None if self.optimizer_step_s is None else self.optimizer_step_s * factor
        return replace(
            self,
            layers=layers,
            optimizer_step_s=step,
            notes={**self.notes, "compute_slowdown": why},
        )

    def scaled(self, factor: int) -> Profile:
        """This profile at ``factor`` times the batch: compute time, FLOPs and activation
        bytes scale linearly (the roofline estimate's own model), parameters and optimizer
        state do not."""
        if factor < 1:
            raise PipeswapError(f"a profile scales by a whole factor of 1 or more, not {factor}")
        layers = tuple(
            replace(
                layer,
                forward_s=layer.forward_s * factor,
                backward_s=layer.backward_s * factor,
                output_bytes=layer.output_bytes * factor,
                saved=tuple(SavedTensor(t.index, t.bytes * factor) for t in layer.saved),
                workspace_bytes=layer.workspace_bytes * factor,
                forward_flops=layer.forward_flops * factor,
                backward_flops=layer.backward_flops * factor,
            )
            for layer in self.layers
        )
        # What a meter read at one batch does not scale by rule: the scaled profile has none.
        return replace(self, batch=self.batch * factor, layers=layers, memory=None)

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
                **(
                    {}
                    if self.optimizer_step_s is None
                    else {"optimizer_step_s": self.optimizer_step_s}
                ),
                "totals": {
                    "param_bytes": self.param_bytes,
                    "saved_bytes": self.saved_bytes,
                    "forward_s": self.forward_s,
                    "backward_s": self.backward_s,
                    "peak_training_bytes": self.peak_training_bytes(),
                },
                "notes": self.notes,
                **({} if self.memory is None else {"memory": self.memory.to_json()}),
                "layers": [layer.to_json() for layer in self.layers],
            }
        )
        return obj

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "profile") -> Profile:
        """A profile from its JSON; any missing or out-of-range field is a PipeswapError
        naming the file, the layer and the field."""
        obj = fields.as_object(obj, where)
        check_format(obj, PROFILE_FORMAT, where)
        # The "malformed profile" prefix tells a reader it is the file, not the request.
        where = f"{where}: malformed profile"
        raw_layers = fields.list_field(obj, "layers", where)
        layers = tuple(
            LayerProfile.from_json(layer, f"{where}: layer {i}")
            for i, layer in enumerate(raw_layers)
        )
        names = [layer.name for layer in layers]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise PipeswapError(
                f"{where}: layer names repeat ({', '.join(map(repr, repeated))}); a plan names "
                "layers, so each needs its own name: write the profile again with "
                "`pipeswap profile`"
            )
        # Older files have no has_saved_data: they carry saved data when every layer lists it.
        has_saved = obj.get("has_saved_data", all("saved" in la for la in raw_layers))
        if not isinstance(has_saved, bool):
            raise PipeswapError(
                f"{where}: has_saved_data is {fields.shown(has_saved)}; write true or false"
            )
        notes = obj.get("notes", {})
        if not isinstance(notes, dict):
            raise PipeswapError(f"{where}: notes is {fields.shown(notes)}; write a JSON object")
        profile = cls(
            model=fields.text_field(obj, "model", where),
            batch=fields.count_field(obj, "batch", where, minimum=1),
            dtype=fields.text_field(obj, "dtype", where, "float32"),
            source=fields.text_field(obj, "source", where, "measured"),
            device=fields.text_field(obj, "device", where, "cpu"),
            optimizer=fields.text_field(obj, "optimizer", where, "sgd"),
            optimizer_state_bytes=fields.count_field(
                obj, "optimizer_state_bytes", where, default=0
            ),
            layers=layers,
            seq_len=None
            if obj.get("seq_len") is None
            else fields.count_field(obj, "seq_len", where, minimum=1),
            image_size=(
                None
                if obj.get("image_size") is None
                else fields.count_field(obj, "image_size", where, minimum=1)
            ),
            has_saved_data=has_saved,
            optimizer_step_s=(
                None
                if obj.get("optimizer_step_s") is None
                else fields.seconds_field(obj, "optimizer_step_s", where)
            ),
            notes=dict(notes),
            memory=None
            if obj.get("memory") is None
            else StepMemory.from_json(obj["memory"], f"{where}: memory", len(layers)),
        )
        memory = profile.memory
        if memory is not None and memory.start_bytes < profile.param_bytes:
            # A step starts holding its parameters at least: a plan would fit what cannot.
            raise PipeswapError(
                f"{where}: memory start_bytes {memory.start_bytes} is less than the "
                f"parameters' {profile.param_bytes} bytes; measure it again (pipeswap "
                "profile), or drop memory to plan from the saved tensors"
            )
        return profile

    def save(self, path: str | os.PathLike[str]) -> None:
        dump_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        return cls.from_json(load_json(path), where=str(path))
