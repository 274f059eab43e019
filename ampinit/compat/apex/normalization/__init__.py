"""``apex.normalization``: Apex's fused layer norms, on torch's own ``layer_norm`` / ``rms_norm``.

Same constructors and parameters as Apex (so state dicts load both ways); the statistics are computed in fp32
(float64 for float64 inputs), as Apex's kernels do, and the output dtype follows Apex's rule: the input's for
``FusedLayerNorm``/``FusedRMSNorm``, the weight's for the ``MixedFused`` variants. See docs/migration.md.
"""

from ampinit.compat.apex.normalization.fused_layer_norm import (
    FusedLayerNorm,
    FusedRMSNorm,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
)

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm"]
