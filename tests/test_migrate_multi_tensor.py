"""``--to torch`` on Megatron-style ``multi_tensor_applier(amp_C.<kernel>, ...)`` calls (issue 15, point 7):
``multi_tensor_l2norm`` and ``multi_tensor_scale`` become functions written into the file on torch's foreach ops
and ``linalg.vector_norm``, with Apex's results (fp32 norm of shape [1], fp32 products written in the output's
dtype, the overflow buffer set on inf/NaN inputs); what could observe a difference is refused with the reason.
The inputs are synthetic (Megatron's clip_grads shape, written small); the expected output was written by hand,
and the migrated file is run against the original under the Apex aliases (``ampinit run``)."""

from __future__ import annotations

import textwrap

import pytest
import torch

from ampinit.migrate import migrate_source
from tests._scripts import as_apex_code, exec_source

CLIP = textwrap.dedent(
    """
    import amp_C
    import torch
    from apex.multi_tensor_apply import multi_tensor_applier


    def clip_grads(grads, max_norm):
        overflow_buf = torch.zeros(1, dtype=torch.int, device=grads[0].device)
        grad_norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow_buf, [grads], False)
        clip_coeff = max_norm / (grad_norm.item() + 1.0e-6)
        if clip_coeff < 1.0:
            multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [grads, grads], clip_coeff)  # noqa: E501
        return grad_norm


    def copy_scaled(sources, outputs, scale):
        overflow = torch.zeros(1, dtype=torch.int)
        multi_tensor_applier(amp_C.multi_tensor_scale, overflow, [sources, outputs], scale)
        return overflow
    """
)

CLIP_TORCH = textwrap.dedent(
    '''
    import torch


    def foreach_l2norm(tensor_lists, per_tensor=False):
        """amp_C.multi_tensor_l2norm as Apex computes it: the L2 norm of all tensors of tensor_lists[0] together,
        accumulated in fp32, as a shape-[1] fp32 tensor, and each tensor's norm (empty unless per_tensor); written by
        ampinit migrate --to torch."""
        norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensor_lists[0]])
        return torch.linalg.vector_norm(norms).reshape(1), norms if per_tensor else norms.new_empty(0)


    def foreach_scale(overflow_buf, tensor_lists, scale):
        """amp_C.multi_tensor_scale as Apex computes it: out = in * scale in fp32, written in out's dtype, for
        tensor_lists = [inputs, outputs]; overflow_buf is set to 1 when an input holds an inf or a NaN; written by
        ampinit migrate --to torch."""
        inputs, outputs = tensor_lists
        nonfinite = torch.stack([~torch.isfinite(t).all() for t in inputs]).any()
        overflow_buf.masked_fill_(nonfinite, 1)
        for source, target in zip(inputs, outputs):
            target.copy_(source.float() * scale)


    def clip_grads(grads, max_norm):
        overflow_buf = torch.zeros(1, dtype=torch.int, device=grads[0].device)
        grad_norm, _ = foreach_l2norm([grads], False)
        clip_coeff = max_norm / (grad_norm.item() + 1.0e-6)
        if clip_coeff < 1.0:
            foreach_scale(overflow_buf, [grads, grads], clip_coeff)  # noqa: E501
        return grad_norm


    def copy_scaled(sources, outputs, scale):
        overflow = torch.zeros(1, dtype=torch.int)
        foreach_scale(overflow, [sources, outputs], scale)
        return overflow
    '''
)


def test_l2norm_and_scale_calls_become_foreach_functions() -> None:
    result = migrate_source(CLIP, "torch")
    assert not result.refused and not result.needs_human, [s.render() for s in result.sites]
    assert result.migrated == CLIP_TORCH
    assert [s.line for s in result.sites] == [9, 12, 18]
    assert migrate_source(result.migrated, "torch").migrated == result.migrated  # a second pass changes nothing


def _namespace(source: str, apex_aliases: bool) -> dict[str, object]:
    with as_apex_code(apex_aliases):
        return exec_source(source, "clip.py")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_migrated_kernels_compute_what_apex_does(dtype: torch.dtype, session_cleanup: None) -> None:
    native = _namespace(migrate_source(CLIP, "torch").migrated, apex_aliases=False)
    original = _namespace(CLIP, apex_aliases=True)
    torch.manual_seed(0)
    grads = [torch.randn(n).mul(30).to(dtype) for n in (5, 300, 7)]
    results = []
    for namespace in (native, original):
        copies = [g.clone() for g in grads]
        norm = namespace["clip_grads"](copies, 1.0)  # type: ignore[operator]
        results.append((norm, copies))
    (norm, clipped), (apex_norm, apex_clipped) = results
    assert norm.shape == apex_norm.shape == (1,) and norm.dtype == apex_norm.dtype == torch.float32
    torch.testing.assert_close(norm, apex_norm, rtol=1e-6, atol=0)
    reference = torch.linalg.vector_norm(torch.cat([g.double() for g in grads])).float()
    torch.testing.assert_close(norm, reference.reshape(1), rtol=1e-6, atol=0)
    for mine, theirs in zip(clipped, apex_clipped):
        assert mine.dtype == dtype
        torch.testing.assert_close(mine, theirs, rtol=1e-6 if dtype == torch.float32 else 0, atol=0)
    # fp16 inputs into fp32 outputs: the product is written in fp32, not rounded to fp16 first
    sources, outputs = [g.half() for g in grads], [torch.empty(g.shape) for g in grads]
    for namespace in (native, original):
        namespace["copy_scaled"](sources, outputs, 1.0 / 3.0)  # type: ignore[operator]
        torch.testing.assert_close(outputs[1], sources[1].float() * (1.0 / 3.0), rtol=0, atol=0)


def test_the_overflow_buffer_is_set_as_apex_sets_it(session_cleanup: None) -> None:
    native = _namespace(migrate_source(CLIP, "torch").migrated, apex_aliases=False)
    original = _namespace(CLIP, apex_aliases=True)
    for value, flag in ((1.0, 0), (float("inf"), 1), (float("nan"), 1)):
        for namespace in (native, original):
            sources = [torch.ones(3), torch.tensor([2.0, value])]
            outputs = [torch.empty(3), torch.empty(2)]
            overflow = namespace["copy_scaled"](sources, outputs, 2.0)  # type: ignore[operator]
            assert overflow.tolist() == [flag]  # type: ignore[attr-defined]
            assert outputs[0].tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize(
    ("old", "new", "reason"),
    [
        (
            "    return grad_norm\n",
            "    return grad_norm, overflow_buf.item()\n",
            "the overflow buffer `overflow_buf` of amp_C.multi_tensor_l2norm is read elsewhere in the file",
        ),
        (
            "    multi_tensor_applier(amp_C.multi_tensor_scale, overflow, [sources, outputs], scale)\n",
            "    done = multi_tensor_applier(amp_C.multi_tensor_scale, overflow, [sources, outputs], scale)\n",
            "the result of multi_tensor_applier(amp_C.multi_tensor_scale, ...) is used: Apex returns None there",
        ),
        (
            "[grads], False)",
            "[grads], per_tensor=False)",
            "multi_tensor_applier(amp_C.multi_tensor_l2norm, ...) with keyword or starred arguments",
        ),
    ],
    ids=["buffer-read", "result-used", "keyword"],
)
def test_calls_that_could_observe_a_difference_are_refused(old: str, new: str, reason: str) -> None:
    assert old in CLIP
    result = migrate_source(CLIP.replace(old, new), "torch")
    assert result.refused and not result.changed
    assert any(reason in s.message for s in result.needs_human), [s.render() for s in result.sites]
    assert not any(s.message.startswith("amp_C ") for s in result.needs_human)  # the specific reason, not the generic


def test_another_kernel_keeps_the_file_refused() -> None:
    source = (
        CLIP
        + "\n\ndef ema(a, b, buf):\n    multi_tensor_applier(amp_C.multi_tensor_axpby, buf, [a, b, a], 0.9, 0.1, -1)\n"
    )
    result = migrate_source(source, "torch")
    assert result.refused and not result.changed
    assert any(s.message.startswith("amp_C has no native torch equivalent") for s in result.needs_human)
