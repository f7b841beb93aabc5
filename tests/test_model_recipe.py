"""Model features of the training recipe: QK-norm and zero-initialised output projections."""

from __future__ import annotations

import json

import pytest
import torch

from model import LlamaConfig, LlamaForPretraining, export_hf, get_preset
from model.kv_cache import KVCache


def tiny(seed: int = 0, **overrides: object) -> LlamaForPretraining:
    torch.manual_seed(seed)
    return LlamaForPretraining(get_preset("tiny", initializer_range=0.1, **overrides)).eval()


def scale_queries_and_keys(model: LlamaForPretraining, factor: float) -> None:
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            qk_rows = (attn.num_heads + attn.num_kv_heads) * attn.head_dim
            attn.qkv_proj.weight[:qk_rows] *= factor


@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys(qk_norm: bool) -> None:
    model = tiny(qk_norm=qk_norm)
    ids = torch.randint(0, 2048, (2, 12))
    with torch.no_grad():
        before = model(ids)
        scale_queries_and_keys(model, 3.0)
        after = model(ids)
    if qk_norm:
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    else:
        assert (after - before).abs().max() > 1e-2  # the test can tell the difference


def test_qk_norm_keeps_causality_and_incremental_decoding() -> None:
    model = tiny(qk_norm=True)
    ids = torch.randint(0, 2048, (1, 10))
    with torch.no_grad():
        full = model(ids)
        changed = ids.clone()
        changed[0, 7:] = (changed[0, 7:] + 1) % 2048
        torch.testing.assert_close(model(changed)[:, :7], full[:, :7])
        cache = KVCache(model.config, batch_size=1, max_len=10)
        steps = [model(ids[:, :4], kv_cache=cache)]
        steps += [model(ids[:, i : i + 1], kv_cache=cache) for i in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


def test_zero_initialised_output_projections_start_every_block_as_the_identity() -> None:
    model = tiny(zero_init_output_projections=True)
    for layer in model.model.layers:
        assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any()
        assert layer.self_attn.qkv_proj.weight.std() > 0.05  # the rest keeps its random init
    ids = torch.randint(0, 2048, (2, 8))
    with torch.no_grad():
        skip_blocks = model.lm_head(model.model.norm(model.model.embed_tokens(ids)))
        torch.testing.assert_close(model(ids), skip_blocks)
    loss = model(ids).logsumexp(-1).mean()
    loss.backward()
    assert model.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0  # and they do train


def test_config_round_trip_and_hugging_face_export(tmp_path) -> None:
    config = get_preset("tiny", qk_norm=True, zero_init_output_projections=True)
    assert LlamaConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match=r"qk_norm=True.*train with qk_norm=False to export"):
        export_hf(LlamaForPretraining(config), tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    out = export_hf(tiny(zero_init_output_projections=True), tmp_path / "hf")
    written = json.loads((out / "config.json").read_text())
    assert "qk_norm" not in written and "zero_init_output_projections" not in written
