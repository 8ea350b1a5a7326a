"""Actions: the compact string form, and ActionKind's members and properties.

Covers: pipeswap/schedule/actions.py.
"""

from __future__ import annotations

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.schedule.actions import ACTION_KINDS, COMPUTE_KINDS, Action, ActionKind


def test_action_string_round_trip() -> None:
    for kind in ACTION_KINDS:
        action = Action(3, kind, 12)  # type: ignore[arg-type]
        assert Action.parse(str(action)) == action
    assert str(Action(2, "F", 5)) == "2F5"  # type: ignore[arg-type]
    assert str(Action(1, "B", 3)) == "1B3"  # type: ignore[arg-type]
    with pytest.raises(PipeswapError, match="2F5"):
        Action.parse("F2")


def test_action_kinds_are_an_enum_that_keeps_the_compact_form() -> None:
    action = Action(2, "SEND_F", 5)  # type: ignore[arg-type]
    assert action.kind is ActionKind.SEND_F and action == Action(2, ActionKind.SEND_F, 5)
    assert str(action) == "2SEND_F5" and Action.parse("2SEND_F5") == action
    assert [k.value for k in ActionKind] == [
        "F",
        "B",
        "SEND_F",
        "RECV_F",
        "SEND_B",
        "RECV_B",
        "UPDATE",
    ]


def test_bad_actions_are_refused() -> None:
    with pytest.raises(PipeswapError, match="unknown action kind 'X'"):
        Action(0, "X", 1)  # type: ignore[arg-type]
    with pytest.raises(PipeswapError, match="negative index"):
        Action(0, ActionKind.F, -1)


def test_each_kind_says_what_it_is() -> None:
    assert [k for k in ActionKind if k.is_pass] == [ActionKind.F, ActionKind.B]
    assert [k for k in ActionKind if k.is_compute] == list(COMPUTE_KINDS)
    assert [k for k in ActionKind if k.is_send] == [ActionKind.SEND_F, ActionKind.SEND_B]
    assert [k for k in ActionKind if k.is_receive] == [ActionKind.RECV_F, ActionKind.RECV_B]
    assert Action(0, ActionKind.UPDATE, 0).is_compute
    assert not Action(0, ActionKind.RECV_B, 0).is_compute


@pytest.mark.parametrize(
    "kind,direction,step,peer_of_2",
    [
        (ActionKind.F, ActionKind.F, 1, 3),
        (ActionKind.SEND_F, ActionKind.F, 1, 3),
        (ActionKind.RECV_F, ActionKind.F, 1, 1),
        (ActionKind.B, ActionKind.B, -1, 1),
        (ActionKind.SEND_B, ActionKind.B, -1, 1),
        (ActionKind.RECV_B, ActionKind.B, -1, 3),
    ],
)
def test_data_moves_forward_after_F_and_back_after_B(
    kind: ActionKind, direction: ActionKind, step: int, peer_of_2: int
) -> None:
    assert kind.direction is direction and kind.step == step
    assert kind.send is direction.send and kind.receive is direction.receive
    assert kind.send.direction is direction and kind.receive.direction is direction
    # A send goes to, a receive comes from, the peer on the direction's side.
    assert kind.peer(2) == peer_of_2
    # The plain string is the kind: JSON, dict keys and checkpoints keep "F" and "B".
    assert kind.direction == direction.value and hash(kind) == hash(kind.value)


def test_an_update_moves_no_data() -> None:
    with pytest.raises(PipeswapError, match="UPDATE moves no data"):
        ActionKind.UPDATE.direction  # noqa: B018
