"""Model features of the training recipe: QK-norm, zero-initialised output projections, value
embeddings."""

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


def test_value_embeddings_mix_a_gated_token_table_into_the_values_of_the_first_and_last_layers() -> None:
    config = get_preset("tiny", num_hidden_layers=4, value_embeds=1, initializer_range=0.1)
    torch.manual_seed(0)
    model = LlamaForPretraining(config).eval()
    fed = [i for i, layer in enumerate(model.model.layers) if layer.self_attn.value_embed_gate is not None]
    assert fed == [0, 3] and config.value_embed_index(3) == 0
    assert model.model.layers[0].self_attn.value_embed_gate.tolist() == [1.0, 0.5]
    plain = LlamaForPretraining(config.replace(value_embeds=0)).eval()
    plain.load_state_dict(model.state_dict(), strict=False)  # the same weights, without the table
    ids = torch.randint(0, 2047, (2, 12))
    ids[0, 5] = 2047  # a token that occurs once
    with torch.no_grad():
        assert (model(ids) - plain(ids)).abs().max() > 1e-2  # the table reaches the output
        for i in fed:
            model.model.layers[i].self_attn.value_embed_gate[1] = 0.0
        torch.testing.assert_close(model(ids), plain(ids))  # and only through the gates
        model.model.layers[3].self_attn.value_embed_gate[1] = 0.5
        changed = model(ids)
        model.model.value_embeds[0].weight[2047] += 1.0  # that token's row: seen from its position on
        after = model(ids)
    torch.testing.assert_close(after[0, :5], changed[0, :5])
    assert (after[0, 5] - changed[0, 5]).abs().max() > 1e-3
    torch.testing.assert_close(after[1], changed[1])


def _decoded_logits(model: LlamaForPretraining, ids: torch.Tensor) -> torch.Tensor:
    """Logits of `ids` from a 4-token prefill and then one token at a time through the KV cache."""
    cache = KVCache(model.config, batch_size=ids.shape[0], max_len=ids.shape[1])
    steps = [model(ids[:, :4], kv_cache=cache)]
    steps += [model(ids[:, i : i + 1], kv_cache=cache) for i in range(4, ids.shape[1])]
    return torch.cat(steps, dim=1)


def test_value_embeddings_keep_incremental_decoding() -> None:
    model = tiny(value_embeds=1)
    ids = torch.randint(0, 2048, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(_decoded_logits(model, ids), model(ids), rtol=1e-4, atol=1e-4)


def test_config_round_trip_and_hugging_face_export(tmp_path) -> None:
    config = get_preset("tiny", qk_norm=True, zero_init_output_projections=True)
    assert LlamaConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match=r"qk_norm=True.*train with qk_norm=False to export"):
        export_hf(LlamaForPretraining(config), tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    with pytest.raises(ValueError, match=r"value_embeds > 0.*train with value_embeds=0 to export"):
        export_hf(LlamaForPretraining(get_preset("tiny", value_embeds=1)), tmp_path / "refused")
    assert LlamaConfig.from_dict(get_preset("tiny", value_embeds=1).to_dict()).value_embeds == 1
    # A config written while the model still had bigram hash embeddings: off loads, on is refused by name.
    assert LlamaConfig.from_dict({**config.to_dict(), "bigram_embeds": 0}) == config
    with pytest.raises(ValueError, match=r"bigram hash embeddings \(bigram_embeds=64\)"):
        LlamaConfig.from_dict({**config.to_dict(), "bigram_embeds": 64})
    for bad in (-1, 2, True, 1.0):  # tiny has 2 layers: at most one table
        with pytest.raises(
            ValueError, match="value_embeds must be an integer from 0 to num_hidden_layers // 2"
        ):
            get_preset("tiny", value_embeds=bad)
    out = export_hf(tiny(zero_init_output_projections=True), tmp_path / "hf")
    written = json.loads((out / "config.json").read_text())
    assert not {"qk_norm", "zero_init_output_projections", "value_embeds"} & set(written)
