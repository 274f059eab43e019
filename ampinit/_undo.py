"""Record-and-restore for changes made to objects ampinit does not own.

An :class:`UndoStack` holds one action per change, pushed as the change is made. :meth:`UndoStack.run` undoes
them last-first (a later change may build on an earlier one), runs every action even when one raises, and then
re-raises the first error, so one failing restore never leaves the other changes in place.

The one kind of change worth a helper is rebinding an attribute (an optimizer's ``step``, a module's function):
:meth:`UndoStack.rebind` sets it and records how to put back exactly what was there::

    undo = UndoStack()
    undo.rebind(optimizer, "step", wrapped_step)   # optimizer.step is now wrapped_step
    undo.push(handle.remove)                       # any other change: push the callable that reverts it
    undo.run()                                     # handle removed, then optimizer.step is the original again
"""

from __future__ import annotations

from collections.abc import Callable


class UndoStack:
    """Undo actions in the order their changes were made; :meth:`run` reverts them in reverse."""

    def __init__(self) -> None:
        self._actions: list[Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self._actions)

    def push(self, action: Callable[[], None]) -> None:
        """Record ``action`` as the way to revert the change just made."""
        self._actions.append(action)

    def rebind(self, obj: object, name: str, value: object) -> None:
        """``setattr(obj, name, value)``, recorded.

        Undoing puts back the object's own previous attribute. If there was none (the name came from the class,
        as an optimizer's ``step`` does), the instance attribute is deleted, but only while it is still
        ``value``: if someone rebound it after us, their binding is theirs to keep.
        """
        namespace = vars(obj)
        had_own = name in namespace
        previous = namespace.get(name)
        setattr(obj, name, value)

        def restore() -> None:
            if had_own:
                setattr(obj, name, previous)
            elif vars(obj).get(name) is value:
                delattr(obj, name)

        self._actions.append(restore)

    def run(self) -> None:
        """Run every recorded action, last first, and empty the stack; re-raise the first error afterwards."""
        first_error: BaseException | None = None
        while self._actions:
            action = self._actions.pop()
            try:
                action()
            except BaseException as err:  # the remaining changes must still be reverted
                if first_error is None:
                    first_error = err
        if first_error is not None:
            raise first_error
