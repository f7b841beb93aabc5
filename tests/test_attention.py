"""Attention kernels (model/attention.py): the matmul form equals SDPA forward and backward, document masking
keeps every document to itself, and the compiled training graph has no breaks."""

from __future__ import annotations

import pytest
import torch

from model import LlamaForPretraining, get_preset
from model.attention import document_ids_from_eos, make_plan

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
EOS = 1


def tiny(seed: int = 0) -> LlamaForPretraining:
    torch.manual_seed(seed)
    return LlamaForPretraining(get_preset("tiny", initializer_range=0.1))


def packed(batch: int = 2, seq: int = 48, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 8192, (batch, seq), generator=gen)
    ids[0, [10, 11, 30]] = EOS  # documents of 11, 1, 19 and 17 tokens
    ids[1, 0] = EOS  # a one-token document first
    return ids


def logits_and_grads(
    model: LlamaForPretraining, backend: str, ids: torch.Tensor, docs: torch.Tensor | None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.attention_backend = backend
    model.zero_grad(set_to_none=True)
    logits = model(ids, document_ids=docs)
    logits.float().square().mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def test_document_ids_close_each_document_with_its_eos() -> None:
    ids = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8], [EOS, 4, 4, 4, 4, 4, 4]])
    assert document_ids_from_eos(ids, EOS).tolist() == [[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("documents", [False, True])
def test_matmul_attention_equals_sdpa_forward_and_backward(documents: bool) -> None:
    model, ids = tiny(), packed()
    docs = document_ids_from_eos(ids, EOS) if documents else None
    ref_logits, ref_grads = logits_and_grads(model, "sdpa", ids, docs)
    logits, grads = logits_and_grads(model, "matmul", ids, docs)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["sdpa", "matmul"])
def test_a_document_inside_a_packed_block_sees_only_itself(backend: str) -> None:
    """RoPE is relative, so a document scored inside a block equals the same document scored alone."""
    model, ids = tiny(), packed()
    model.attention_backend = backend
    docs = document_ids_from_eos(ids, EOS)
    with torch.no_grad():
        in_block = model(ids, document_ids=docs)
        for start, end in [(0, 11), (11, 12), (12, 31), (31, 48)]:
            alone = model(ids[:1, start:end])
            torch.testing.assert_close(in_block[:1, start:end], alone, rtol=1e-4, atol=1e-4)
        plain = model(ids)
    # Without the mask the later documents see the earlier ones: the mask is what changes them.
    assert torch.allclose(plain[0, :11], in_block[0, :11], atol=1e-5)
    assert not torch.allclose(plain[0, 12:], in_block[0, 12:], atol=1e-3)


def test_matmul_attention_in_bf16_autocast_is_as_close_to_fp32_as_sdpa() -> None:
    model, ids = tiny(), packed()
    docs = document_ids_from_eos(ids, EOS)
    ref, ref_grads = logits_and_grads(model, "sdpa", ids, docs)
    errors = {}
    for backend in ("sdpa", "matmul"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, grads = logits_and_grads(model, backend, ids, docs)
        grad_err = max(((g - r).norm() / r.norm()).item() for g, r in zip(grads, ref_grads, strict=True))
        errors[backend] = ((logits.float() - ref).abs().max().item(), grad_err)
    assert errors["matmul"][0] <= 2 * errors["sdpa"][0] + 1e-3, errors
    assert errors["matmul"][1] <= 2 * errors["sdpa"][1] + 1e-3, errors


def test_compiled_training_graph_with_document_mask_has_no_breaks_and_matches_eager() -> None:
    model, ids = tiny(), packed()
    docs = document_ids_from_eos(ids, EOS)
    eager_logits, eager_grads = logits_and_grads(model, "matmul", ids, docs)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    model.zero_grad(set_to_none=True)
    logits = compiled(ids, document_ids=docs)
    logits.float().square().mean().backward()
    torch.testing.assert_close(logits.detach(), eager_logits, rtol=1e-4, atol=1e-4)
    for p, ref in zip(model.parameters(), eager_grads, strict=True):
        torch.testing.assert_close(p.grad, ref, rtol=1e-3, atol=1e-5)


def test_auto_plan_picks_matmul_on_cpu_and_sdpa_for_long_sequences() -> None:
    cpu = torch.device("cpu")
    assert make_plan("auto", cpu, 256, None).kind == "matmul"
    assert make_plan("auto", cpu, 4096, None).kind == "sdpa"
    assert make_plan("auto", cpu, 4096, None).is_causal
    long_docs = torch.zeros(1, 4096, dtype=torch.int64)
    assert make_plan("auto", cpu, 4096, long_docs).mask is not None


def test_document_ids_are_refused_with_padding_or_a_kv_cache_and_with_the_wrong_shape() -> None:
    model, ids = tiny(), packed()
    docs = document_ids_from_eos(ids, EOS)
    with pytest.raises(ValueError, match="cannot be combined with attn_mask"):
        model(ids, torch.ones_like(ids), document_ids=docs)
    with pytest.raises(ValueError, match="shape of input_ids"):
        model(ids, document_ids=docs[:, :5])
