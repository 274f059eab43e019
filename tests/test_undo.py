"""``ampinit._undo``: record-and-restore, reverse order, and every action run even when some raise."""

from __future__ import annotations

import types

import pytest

from ampinit._undo import UndoStack


class Widget:
    def step(self) -> str:
        return "class step"


def test_rebind_of_a_class_attribute_is_removed_from_the_instance() -> None:
    widget = Widget()
    undo = UndoStack()
    undo.rebind(widget, "step", lambda: "wrapped")
    assert widget.step() == "wrapped" and "step" in vars(widget)
    undo.run()
    assert "step" not in vars(widget) and widget.step() == "class step"


def test_rebind_of_an_own_attribute_puts_the_previous_value_back() -> None:
    module = types.ModuleType("fake")
    original = object()
    module.f = original  # type: ignore[attr-defined]
    undo = UndoStack()
    undo.rebind(module, "f", "patched")
    undo.rebind(module, "f", "patched twice")
    assert module.f == "patched twice"  # type: ignore[attr-defined]
    undo.run()
    assert module.f is original  # type: ignore[attr-defined]


def test_a_later_rebinding_by_someone_else_is_kept() -> None:
    widget = Widget()
    undo = UndoStack()
    undo.rebind(widget, "step", lambda: "ours")
    theirs = lambda: "theirs"  # noqa: E731
    widget.step = theirs  # type: ignore[method-assign]
    undo.run()
    assert widget.step is theirs


def test_actions_run_last_first_and_the_stack_empties() -> None:
    order: list[int] = []
    undo = UndoStack()
    for index in range(4):
        undo.push(lambda index=index: order.append(index))  # type: ignore[misc]
    assert len(undo) == 4
    undo.run()
    assert order == [3, 2, 1, 0] and len(undo) == 0
    undo.run()
    assert order == [3, 2, 1, 0]


def test_every_action_runs_and_the_first_error_is_raised() -> None:
    ran: list[str] = []

    def fail(name: str) -> None:
        ran.append(name)
        raise ValueError(name)

    undo = UndoStack()
    undo.push(lambda: ran.append("first change"))
    undo.push(lambda: fail("second change"))
    undo.push(lambda: ran.append("third change"))
    undo.push(lambda: fail("fourth change"))
    with pytest.raises(ValueError, match=r"^fourth change$"):
        undo.run()
    assert ran == ["fourth change", "third change", "second change", "first change"]
    assert len(undo) == 0
