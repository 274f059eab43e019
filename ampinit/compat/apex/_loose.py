"""Apex's loose argument values, converted once at the border to what ampinit's strict core takes.

Apex stored most of ``initialize``'s and ``scale_loss``'s arguments as given and only compared them later
(read in Apex's ``apex/amp/frontend.py``, ``_amp_state.py``, ``_initialize.py`` and ``handle.py`` before commit
cb65b8ed, 2025-05-08, which deleted amp). So real code passes ``verbosity=args.local_rank == 0`` (a bool; Apex
compared ``verbosity > 0`` and ``== 2``), ``enabled=args.fp16`` (an int or None; Apex tested ``if not enabled``),
``master_weights=1`` (tested for truth) or numpy numbers read from a config. Each converter below accepts what
Apex's use of the value accepted and returns the value that behaves the same in ampinit; a value Apex would also
have failed on raises here, naming the value and what is allowed.
"""

from __future__ import annotations

import numbers


def truth(value: object) -> object:
    """Apex tested ``enabled``, ``delay_unscale`` and ``delay_overflow_check`` for truth (``if not enabled``).

    The strings ``"True"``/``"False"`` go through unchanged: ampinit's core already reads them as their words.
    """
    return value if isinstance(value, str) else bool(value)


def optional_truth(value: object) -> object:
    """``patch_torch_functions`` and ``master_weights``: ``None`` keeps the level's default, numbers are truth
    values (Apex stored them and tested them with ``if properties.master_weights:``), strings pass through."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Number):
        return bool(value)
    return value


def whole_number(name: str, value: object) -> object:
    """``verbosity``, ``num_losses`` and ``loss_id``: bools and numpy integers are the ints they equal.

    Apex compared ``verbosity`` with 0 and 2, ran ``range(num_losses)`` and indexed a list with ``loss_id``:
    each accepts ``True`` (as 1) and anything with ``__index__``; a float equal to a whole number compares like it.
    """
    if isinstance(value, numbers.Integral):  # bool and numpy ints included: True is 1
        return int(value)
    if isinstance(value, numbers.Real) and float(value).is_integer():
        return int(float(value))
    if isinstance(value, numbers.Number):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return value


def real_number(value: object) -> object:
    """``min_loss_scale``/``max_loss_scale``: Apex did arithmetic with them, so any real number (numpy's
    ``float32`` included, which is no Python float) is its float; ``None`` (no floor) stays."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value
