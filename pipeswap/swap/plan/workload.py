"""Data-parallel training iterations as a task graph: compute, swaps, recompute, all-reduce, step."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.profiling.profile import Profile
from pipeswap.swap.plan.measured import (
    MeasuredMemory,
    estimated_optimizer_step_s,
    gradients_held,
    measured_memory,
    output_gradients,
    recomputed_inputs,
    selective_fields,
)
from pipeswap.swap.plan.tensors import SwapDecisionAt

__all__ = ["Workload", "workload_from_profile"]


@dataclass(frozen=True)
class Workload:
    """The per-layer numbers of one micro-batch that planning needs, from a Profile.

    **Recomputation** (``recompute``: layer indices; :meth:`recomputing` gives the view of
    one GPU's plan). A recomputed layer is one block under non-reentrant
    ``torch.utils.checkpoint``; the memory model is:

    * forward: the layer allocates its working set (``transient``) as any layer, but keeps
      only its *input* (``input_bytes[i]``: the previous layer's output; for layer 0 the
      batch where layer 0 saves it, else nothing, outside the accounting) instead of its
      saved tensors. That input is counted once, here: the profiler files a storage two
      layers save under the later one (the input of a block saved by the previous block's
      last ReLU belongs to this block). (A previous layer that saves its output while this
      layer does not save its input holds the same storage: counted twice, the safe side.)
    * backward: right before the layer's backward, a compute task of ``forward_s[i]``
      runs the forward again; it allocates the saved tensors the re-run creates
      (``recompute_bytes[i]`` = its saved bytes minus the saved tensor that is its input,
      ``input_saved[i]``, which the re-run saves again without a copy) plus its working
      set (``rerun_working[i]``: the forward's, over the gradients the backward made
      before it, ``gradient_bytes[i]``, and its output's, ``output_gradient_bytes[i]``),
      and frees the working set when it ends; the backward then frees them with the kept
      input, before layer i-1's re-run starts.

    A layer whose forward leaves a tensor carrying its graph on a module (``held_state``;
    pipeswap.swap.runtime.held_state) is never recomputed: its re-run's saved tensors would
    stay held through that graph until the next forward. It frees nothing (``freed_bytes``),
    no policy chooses it (``recomputable``), and :meth:`recomputing` refuses it.

    ``saved_bytes`` are the bytes each layer holds from its forward to its backward (the
    kept input for a recomputed layer); ``all_saved_bytes`` ignore recomputation. A
    recomputed layer has no tensor to swap (``swappable``).

    **Selective recomputation** (``selective``, a view from :meth:`selecting`): a layer
    recomputed selectively keeps, beside its input, the outputs of the operations dear to
    compute (``selective_kept``: both together), its re-run saves ``selective_rerun`` and
    takes ``selective_s`` (pipeswap.swap.runtime.selective). Empty tuples: not measured,
    no layer can be recomputed so.

    **Measured memory** (a profile with ``memory``, :func:`workload_from_profile`): the
    resident bytes are what the device held when the forward started, and each layer's
    working sets (``transient`` in its forward, ``backward_transient`` in its backward) are
    whatever else the meter saw at that point beyond the resident bytes and the saved
    tensors of the layers so far: the model's own code outside the layers, autocast's
    weight copies, gradients as the backward makes them, the allocator's rounding. The
    last layer's forward point also holds the turn (the head, logits, loss and their
    backward). ``floor_bytes`` is the optimizer step's peak, which no plan changes. With
    nothing swapped, the points are the meter's own readings.
    """

    model: str
    names: tuple[str, ...]
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    saved: tuple[tuple[tuple[int, int], ...], ...]  # per layer: (index, bytes)
    transient: tuple[int, ...]  # working memory while the layer runs, forward or backward
    param_bytes: tuple[int, ...]
    resident_bytes: int  # parameters, gradients, optimizer state
    optimizer_step_s: float
    # Per layer: what recomputing it keeps (its input), how much of its saved bytes that is.
    input_bytes: tuple[int, ...] = ()
    input_saved: tuple[int, ...] = ()
    recompute: frozenset[int] = frozenset()
    # Working memory while the layer's backward runs (empty: the forward's, ``transient``).
    backward_transient: tuple[int, ...] = ()
    floor_bytes: int = 0  # the most held outside any layer's points (the optimizer step)
    # Working memory at the turn (the model's code after the last layer: head, logits, loss
    # and their backward), above every layer's saved bytes; counted at the last forward.
    turn_bytes: int = 0
    selective_kept: tuple[int, ...] = ()
    selective_rerun: tuple[int, ...] = ()
    selective_s: tuple[float, ...] = ()
    selective: frozenset[int] = frozenset()  # recomputed layers recomputed selectively
    # Per layer, the gradients held when its backward starts (the later layers' and the
    # head's) beyond the resident bytes; empty: none (an estimate counts them resident).
    gradient_bytes: tuple[int, ...] = ()
    # Per layer, its output's gradient through its re-run (measured.output_gradients).
    output_gradient_bytes: tuple[int, ...] = ()
    # Per layer, the attributes its forward leaves holding the graph ("": none).
    held_state: tuple[str, ...] = ()

    @cached_property
    def recomputable(self) -> tuple[int, ...]:
        """The layers a plan may recompute: all but those that keep state (``held_state``)."""
        return tuple(i for i in range(self.num_layers) if not self.held(i))

    def held(self, layer: int) -> str:
        """The attributes ``layer``'s forward leaves holding the graph ("": none)."""
        return self.held_state[layer] if self.held_state else ""

    @cached_property
    def backward_working(self) -> tuple[int, ...]:
        return self.backward_transient or self.transient

    @cached_property
    def forward_working(self) -> tuple[int, ...]:
        """Per layer: its forward's working set; the last layer's holds the turn too."""
        if not self.transient:
            return ()
        return (*self.transient[:-1], max(self.transient[-1], self.turn_bytes))

    @cached_property
    def rerun_working(self) -> tuple[int, ...]:
        """Per layer: its re-run's working set beyond what it saves: its forward's, over the
        gradients its backward starts with, its parameters' and its output's (no more than
        its backward's working set, which holds them too: where the readings left no room
        for them, the saved bytes counted there hold more than the step did)."""
        none = (0,) * self.num_layers
        held = zip(self.gradient_bytes or none, self.output_gradient_bytes or none, strict=True)
        return tuple(
            t + min(g + o, b) for (g, o), t, b in zip(held, self.transient, self.backward_working)
        )

    @property
    def num_layers(self) -> int:
        return len(self.names)

    @cached_property
    def all_saved_bytes(self) -> tuple[int, ...]:
        return tuple(sum(b for _, b in layer) for layer in self.saved)

    @cached_property
    def kept_bytes(self) -> tuple[int, ...]:
        """Per layer: what it holds through the micro-batch if it is recomputed."""
        kept = self.input_bytes or (0,) * self.num_layers
        if not self.selective:
            return kept
        return tuple(
            self.selective_kept[i] if i in self.selective else k for i, k in enumerate(kept)
        )

    @cached_property
    def freed_bytes(self) -> tuple[int, ...]:
        """Per layer: forward memory that recomputing it frees (negative: it costs memory;
        none for a layer that keeps state, which is never recomputed)."""
        return tuple(
            0 if self.held(i) else s - k
            for i, (s, k) in enumerate(zip(self.all_saved_bytes, self.kept_bytes))
        )

    @cached_property
    def saved_bytes(self) -> tuple[int, ...]:
        # Cached: graph building asks for it per task (frozen dataclasses allow this).
        if not self.recompute:
            return self.all_saved_bytes
        return tuple(
            self.kept_bytes[i] if i in self.recompute else b
            for i, b in enumerate(self.all_saved_bytes)
        )

    @cached_property
    def recompute_bytes(self) -> tuple[int, ...]:
        """Per layer: what its re-run allocates right before its backward (0 if kept)."""
        inputs = self.input_saved or (0,) * self.num_layers
        return tuple(
            (
                self.selective_rerun[i]
                if i in self.selective
                else self.all_saved_bytes[i] - inputs[i]
            )
            if i in self.recompute
            else 0
            for i in range(self.num_layers)
        )

    @cached_property
    def rerun_s(self) -> tuple[float, ...]:
        """Per layer: how long its re-run takes if it is recomputed (whole: its forward)."""
        return tuple(
            self.selective_s[i] if i in self.selective else self.forward_s[i]
            for i in range(self.num_layers)
        )

    @property
    def can_select(self) -> bool:
        """Whether the profile measured selective recomputation."""
        return len(self.selective_kept) == self.num_layers > 0

    @cached_property
    def swappable(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per layer, the saved tensors a plan may swap: none of a recomputed layer."""
        return tuple(() if i in self.recompute else layer for i, layer in enumerate(self.saved))

    @cached_property
    def _views(self) -> dict[frozenset[int], Workload]:
        # Shared by a workload and all its views, so each recompute set is built once.
        return {self.recompute: self}

    def recomputing(self, layers: Collection[int]) -> Workload:
        """This workload with ``layers`` recomputed (and nothing else); views are cached."""
        key = frozenset(layers)
        if key == self.recompute:
            return self
        if stateful := sorted(key - set(self.recomputable)):
            raise PipeswapError(
                f"layer {self.names[stateful[0]]!r} cannot be recomputed: its forward leaves "
                f"{self.held(stateful[0])} holding the graph (state kept past the forward)"
            )
        views = self._views
        if key not in views:
            view = replace(self, recompute=key)
            view.__dict__["_views"] = views
            views[key] = view
        return views[key]

    def selecting(self, layers: Collection[int]) -> Workload:
        """This workload with ``layers``, where recomputed, recomputed selectively (and the
        same recomputed layers); each selection is built once."""
        key = frozenset(layers)
        if key == self.selective:
            return self
        selections = self._selections
        if key not in selections:
            view = replace(self.recomputing(()), selective=key)
            view.__dict__["_selections"] = selections
            selections[key] = view
        return selections[key].recomputing(self.recompute)

    @cached_property
    def _selections(self) -> dict[frozenset[int], Workload]:
        # Shared by a workload and its selections (each with its own recompute views).
        return {self.selective: self.recomputing(())}

    @property
    def recompute_s(self) -> float:
        """Compute added per micro-batch by the recomputed layers' second forward."""
        return sum(self.rerun_s[i] for i in self.recompute)

    @property
    def microbatch_s(self) -> float:
        return sum(self.forward_s) + sum(self.backward_s) + self.recompute_s

    def compute_s(self, sync_every: int) -> float:
        """Compute time of one iteration on one GPU: K micro-batches and the optimizer step."""
        return sync_every * self.microbatch_s + self.optimizer_step_s

    @cached_property
    def working_bytes(self) -> tuple[int, ...]:
        """Per layer: the most it holds beyond the saved bytes of the layers up to it, in
        its forward or its backward (a recomputed layer's backward holds its re-run's saved
        tensors and, while the re-run runs, its working set, ``rerun_working``)."""
        working = []
        for i in range(len(self.transient)):
            backward = self.backward_working[i]
            if i in self.recompute:  # the re-run's own forward, not the turn before it
                backward = max(backward, self.rerun_working[i])
            working.append(max(self.forward_working[i], backward + self.recompute_bytes[i]))
        return tuple(working)

    def _points(self) -> list[int]:
        # Memory at each layer with nothing swapped: the larger of its forward and its
        # backward, above resident state.
        points: list[int] = []
        cumulative = 0
        for saved, working in zip(self.saved_bytes, self.working_bytes):
            cumulative += saved
            points.append(cumulative + working)
        return points

    def no_swap_peak_bytes(self) -> int:
        """Peak memory with nothing swapped: the largest forward or backward point."""
        return max(self.resident_bytes + max(self._points(), default=0), self.floor_bytes)

    def min_budget_bytes(self, *, recomputing: bool = True) -> int:
        """What can never be swapped: resident state, the floor, and at each layer the
        least of keeping its saved tensors (every other layer's swapped away) and, where
        ``recomputing`` (a policy that may recompute), recomputing it (its kept input, its
        re-run), with its working set."""
        layers = range(self.num_layers)
        everything = self.recomputing(self.recomputable)
        least = max(
            min(
                self.saved_bytes[i] + self.working_bytes[i],
                everything.saved_bytes[i] + everything.working_bytes[i]
                if recomputing
                else self.saved_bytes[i] + self.working_bytes[i],
            )
            for i in layers
        )
        return max(self.resident_bytes + least, self.floor_bytes)

    def needs(self, budget_bytes: int) -> list[int]:
        """``needs[i]``: bytes of layers before i that must be off the GPU while layer i runs.

        The larger of what forward i and backward i need off (they differ on a measured
        profile: a backward's working set holds the gradients made so far, the last
        forward the turn). A plan fits (with prefetches issued as late as possible) if, for
        every i, its swapped bytes of layers < i, swapped out before forward i, are at
        least needs[i]; the bounds use each point's own excess (bounds.inputs.MicroBatch).
        """
        return [max(0, self.resident_bytes + point - budget_bytes) for point in self._points()]

    def memory_points(self, swaps: Sequence[SwapDecisionAt]) -> tuple[list[int], list[int]]:
        """Worst-case memory while each forward and each backward runs, per layer.

        Counts a swapped tensor as gone once its swap-out was issued before the forward
        (the simulator makes the forward wait for the copy to finish) and as back once
        its prefetch was issued before the backward (the copy may have taken its memory).
        The backward point of a recomputed layer includes its re-run's saved tensors.
        A plan whose points are all within the budget can never deadlock in simulation.
        """
        n = self.num_layers
        gone_before = [0] * (n + 1)  # bytes whose swap-out is issued before forward i
        # On host during backward j (j >= prefetch): its prefetch is issued after backward
        # ``prefetch``, which comes later than backward j only when prefetch <= j.
        on_host = [0] * (n + 1)
        for s in swaps:
            gone_before[s.out + 1] += s.bytes
            on_host[s.prefetch] += s.bytes
        forward: list[int] = []
        backward: list[int] = []
        cumulative = gone = host = 0
        for i in range(n):
            cumulative += self.saved_bytes[i]
            gone += gone_before[i]
            host += on_host[i]
            forward.append(self.resident_bytes + cumulative - gone + self.forward_working[i])
            # A recomputed layer's re-run runs its forward working set before the backward's.
            working = self.backward_working[i]
            if i in self.recompute:
                working = max(working, self.rerun_working[i])
            backward.append(
                self.resident_bytes + cumulative - host + working + self.recompute_bytes[i]
            )
        return forward, backward

    def need_bytes(self, swaps: Sequence[SwapDecisionAt]) -> int:
        """The most a step with ``swaps`` holds at once: the smallest budget they fit."""
        forward, backward = self.memory_points(swaps)
        return max(max(forward), max(backward), self.floor_bytes)

    def fits(self, swaps: Sequence[SwapDecisionAt], budget_bytes: int) -> bool:
        return self.need_bytes(swaps) <= budget_bytes


def workload_from_profile(profile: Profile, *, optimizer_step_s: float | None = None) -> Workload:
    """The planning view of ``profile``; refuses profiles without saved-tensor data."""
    missing = [layer.name for layer in profile.layers if not layer.saved]
    if not profile.layers:
        raise PipeswapError(f"the profile of {profile.model} has no layers")
    if not profile.has_saved_data or len(missing) == len(profile.layers):
        raise ConfigError(
            f"the profile of {profile.model} has no saved-tensor data, which swap planning "
            f"needs; measure it (pipeswap.measure), or estimate it from the model's config "
            # Prose, not a command: it reads right with flags (CLI) and with field names.
            f"(pipeswap.profiling.estimate, or the profile command with {{model}} "
            f"{profile.model}, {{batch}} {profile.batch}, {{estimate}} and {{gpu}} v100-32gb)"
        )
    if optimizer_step_s is None:
        optimizer_step_s = estimated_optimizer_step_s(profile)
    inputs, input_saved = recomputed_inputs(profile)
    transient = tuple(layer.workspace_bytes + layer.output_bytes for layer in profile.layers)
    memory = MeasuredMemory(profile.resident_bytes, transient, transient, 0, 0)
    if profile.memory is not None:
        memory = measured_memory(profile)
    return Workload(
        model=profile.model,
        names=tuple(profile.layer_names),
        forward_s=tuple(layer.forward_s for layer in profile.layers),
        backward_s=tuple(layer.backward_s for layer in profile.layers),
        saved=tuple(tuple((t.index, t.bytes) for t in layer.saved) for layer in profile.layers),
        transient=memory.transient,
        param_bytes=tuple(layer.param_bytes for layer in profile.layers),
        resident_bytes=memory.resident_bytes,
        optimizer_step_s=optimizer_step_s,
        input_bytes=inputs,
        input_saved=input_saved,
        backward_transient=memory.backward_transient,
        floor_bytes=memory.floor_bytes,
        turn_bytes=memory.turn_bytes,
        gradient_bytes=gradients_held(profile),
        output_gradient_bytes=output_gradients(profile),
        held_state=tuple(layer.held_state or "" for layer in profile.layers),
        **selective_fields(profile),
    )
