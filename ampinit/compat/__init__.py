"""Compatibility layers for code written against other mixed-precision libraries.

``ampinit.compat.apex`` has NVIDIA Apex's public surface (``apex.amp``, ``apex.optimizers``, ``apex.fp16_utils``,
``apex.parallel``, ``apex.multi_tensor_apply``, ``amp_C``) as thin aliases over ampinit; ``install()`` makes
``import apex`` and ``import amp_C`` resolve to them. See docs/migration.md.
"""
