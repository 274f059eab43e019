"""``apex.amp.lists``: Apex's O1 op lists as editable module attributes, read by every O1/O4 ``initialize``.

Code edits them before ``amp.initialize`` as it did with Apex, e.g.
``apex.amp.lists.torch_overrides.FP32_FUNCS.append("sigmoid")``; the next O1/O4 session (``cast_policy="apex"``)
casts by the lists as they are then. See docs/cast-policy.md ("Editing Apex's lists").
"""

from ampinit._casting import lists as _engine_lists
from ampinit.compat.apex.amp.lists import functional_overrides, tensor_overrides, torch_overrides

__all__ = ["functional_overrides", "tensor_overrides", "torch_overrides"]

_MODULES = {
    "functional_overrides": functional_overrides,
    "tensor_overrides": tensor_overrides,
    "torch_overrides": torch_overrides,
}


def _read() -> _engine_lists.ApexLists:
    return _engine_lists.ApexLists.of(
        {
            (name, kind): list(getattr(module, kind, ()))
            for name, module in _MODULES.items()
            for kind in _engine_lists.LIST_KINDS
        }
    )


_engine_lists.read_lists_from(_read)
