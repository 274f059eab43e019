"""``apex.multi_tensor_apply``: ``multi_tensor_applier`` and ``MultiTensorApply``, always available."""

from ampinit.multi_tensor import MultiTensorApply, multi_tensor_applier

__all__ = ["MultiTensorApply", "multi_tensor_applier"]
