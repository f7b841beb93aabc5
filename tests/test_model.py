"""The Llama module: presets and cost arithmetic, padding semantics, init, weights on disk, torch.compile."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from model import (
    MODEL_PRESETS,
    LlamaConfig,
    LlamaForPretraining,
    count_params,
    describe_presets,
    flops_per_token,
    get_preset,
    load_weights,
    save_weights,
    unwrap,
)
from model.weights import read_metadata

# Inductor imports torch.utils.mkldnn, which uses the deprecated torch.jit.script_method.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def tiny(seed: int = 0, **overrides) -> LlamaForPretraining:
    torch.manual_seed(seed)
    return LlamaForPretraining(get_preset("tiny", initializer_range=0.1, **overrides)).eval()


@pytest.fixture(scope="module")
def compiled_pair() -> tuple[LlamaForPretraining, torch.nn.Module]:
    model = tiny()
    return model, torch.compile(model)


# --- presets and arithmetic -------------------------------------------------------------------------------


def test_describe_presets_counts_match_instantiated_models() -> None:
    rows = {row["name"]: row for row in describe_presets(seq_len=1024)}
    assert set(rows) == set(MODEL_PRESETS) == {"tiny", "demo", "small", "125m", "350m", "1b", "7b"}
    for name, row in rows.items():
        with torch.device("meta"):  # shapes only: no memory for the 1B and 7B models
            model = LlamaForPretraining(get_preset(name))
        assert count_params(model) == row["params"], name
        assert count_params(model, non_embedding=True) == row["non_embedding_params"], name
        assert row["flops_per_token"] == flops_per_token(get_preset(name), 1024)
    assert 4e6 <= rows["demo"]["params"] <= 6e6
    assert 30e6 <= rows["small"]["params"] <= 40e6
    assert 115e6 <= rows["125m"]["params"] <= 135e6
    assert 330e6 <= rows["350m"]["params"] <= 370e6
    assert 0.95e9 <= rows["1b"]["params"] <= 1.15e9
    assert 6.6e9 <= rows["7b"]["params"] <= 6.9e9  # Llama 2 7B: 6,738,415,616


def test_python_dash_m_model_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    describe_presets(print_table=True)
    out = capsys.readouterr().out
    assert "125m" in out and f"{count_params(get_preset('demo')):,}" in out


def test_flops_per_token_formula_by_hand() -> None:
    c = get_preset("tiny")
    per_layer = 64 * 16 * (4 + 2 * 2) + 4 * 16 * 64 + 3 * 64 * 176 + 2 * 64
    non_embedding = 2 * per_layer + 64
    assert count_params(c, non_embedding=True) == non_embedding
    assert count_params(c) == non_embedding + 8192 * 64  # tied: one table
    # 6 x (non-embedding + output head matmul) + attention 12·L·H·d·T
    assert flops_per_token(c, 256) == 6 * (non_embedding + 8192 * 64) + 12 * 2 * 4 * 16 * 256
    untied = get_preset("tiny", tie_word_embeddings=False)
    assert count_params(untied) == non_embedding + 2 * 8192 * 64
    assert flops_per_token(untied, 256) == flops_per_token(c, 256)
    # One value-embedding table (vocab x 2 KV heads x 16) counts as embedding; its gates (2 per layer) do not.
    with_ve = get_preset("tiny", value_embeds=1)
    assert count_params(with_ve, non_embedding=True) == non_embedding + 2 * 2
    assert count_params(with_ve) == non_embedding + 2 * 2 + 8192 * 64 + 8192 * 2 * 16
    model = LlamaForPretraining(with_ve)
    assert count_params(model) == count_params(with_ve)
    assert count_params(model, non_embedding=True) == count_params(with_ve, non_embedding=True)
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(c, 0)


def test_config_round_trip_overrides_and_validation() -> None:
    c = get_preset("1b", vocab_size=50000)
    assert c.vocab_size == 50000 and c.rope_scaling["rope_type"] == "llama3" and c.rope_theta == 500000.0
    assert LlamaConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert get_preset("demo", hidden_size=640).head_dim == 64  # derived again from the new width
    assert get_preset("demo").head_dim == 32 and get_preset("demo").num_key_value_groups == 2
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        get_preset("huge")
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        get_preset("tiny", num_key_value_heads=3)
    with pytest.raises(ValueError, match="unknown LlamaConfig fields"):
        get_preset("tiny", hidden=3)
    with pytest.raises(ValueError, match="not supported"):
        get_preset("tiny", rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="positive integer"):
        get_preset("tiny", vocab_size=0)


# --- forward ----------------------------------------------------------------------------------------------


def test_forward_shapes_dtypes_and_autocast() -> None:
    model = tiny()
    ids = torch.randint(0, 8192, (2, 24))
    logits = model(ids)
    assert logits.shape == (2, 24, 8192) and logits.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(ids)
    assert low.dtype == torch.bfloat16
    assert (low.float() - logits).abs().max() < 0.1
    with pytest.raises(ValueError, match="max_position_embeddings 512"):
        model(torch.zeros(1, 513, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(batch, seq\)"):
        model(torch.zeros(5, dtype=torch.long))


def test_causality_future_tokens_do_not_change_the_past() -> None:
    model = tiny()
    ids = torch.randint(0, 8192, (1, 20))
    changed = ids.clone()
    changed[0, 12:] = (changed[0, 12:] + 1) % 8192
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-3


def test_padded_batches_equal_single_sequences_and_padding_is_zero() -> None:
    model = tiny()
    seqs = [torch.randint(3, 8192, (n,)) for n in (16, 9, 5)]
    for side in ("left", "right"):
        ids = torch.full((4, 16), 2)
        mask = torch.zeros(4, 16, dtype=torch.long)
        for row, seq in enumerate(seqs):
            span = slice(16 - len(seq), 16) if side == "left" else slice(0, len(seq))
            ids[row, span], mask[row, span] = seq, 1
        # row 3 is padding only
        logits = model(ids, mask)
        assert torch.isfinite(logits).all(), side
        assert (logits[3] == 0).all(), side
        for row, seq in enumerate(seqs):
            alone = model(seq[None])[0]
            span = slice(16 - len(seq), 16) if side == "left" else slice(0, len(seq))
            torch.testing.assert_close(logits[row, span], alone, rtol=0, atol=2e-5, msg=f"{side} row {row}")
            assert (logits[row][mask[row] == 0] == 0).all()
    with pytest.raises(ValueError, match="attn_mask must have shape"):
        model(ids, mask[:, 1:])


def test_all_ones_mask_equals_no_mask() -> None:
    torch.manual_seed(0)
    model = tiny()
    ids = torch.randint(0, 8192, (2, 10))
    # The two paths run different attention kernels: equal up to float32 rounding (logits of order 1).
    torch.testing.assert_close(model(ids, torch.ones_like(ids)), model(ids), rtol=0, atol=1e-5)


def test_init_is_a_function_of_the_seed_and_of_initializer_range() -> None:
    a, b, c = tiny(seed=1), tiny(seed=1), tiny(seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if "layernorm" in name or name.endswith("norm.weight"):
            assert (pa == 1).all()
        else:
            assert not torch.equal(pa, pc), name
    std = a.model.layers[0].mlp.gate_up_proj.weight.std().item()
    assert 0.09 < std < 0.11  # initializer_range 0.1
    assert a.lm_head.weight is a.model.embed_tokens.weight


def test_rope_tables_stay_float32_and_out_of_the_state_dict() -> None:
    model = tiny()
    assert not any("rope" in key for key in model.state_dict())
    reference = model.rope_cos.clone()
    model.to(torch.bfloat16)
    assert model.rope_cos.dtype == torch.float32 and torch.equal(model.rope_cos, reference)
    assert model.model.norm.weight.dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("value_embeds", [0, 1])
def test_backward_reaches_every_parameter(value_embeds: int) -> None:
    model = tiny(value_embeds=value_embeds).train()
    ids = torch.randint(0, 8192, (2, 12))
    logits = model(ids[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


# --- weights on disk and torch.compile ------------------------------------------------------------------------


def test_weights_round_trip_tied_and_untied(tmp_path) -> None:
    for tied, value_embeds in ((True, 0), (False, 0), (True, 1)):
        model = tiny(tie_word_embeddings=tied, value_embeds=value_embeds)
        path = save_weights(model, tmp_path / f"w{tied}{value_embeds}.safetensors")
        keys = set(load_file(path))
        assert ("lm_head.weight" in keys) is (not tied)
        assert json.loads(read_metadata(path)["config"]) == model.config.to_dict()
        fresh = tiny(seed=9, tie_word_embeddings=tied, value_embeds=value_embeds)
        load_weights(fresh, path)
        (tmp_path / f"dir{tied}{value_embeds}").mkdir()
        save_weights(model, tmp_path / f"dir{tied}{value_embeds}" / "model.safetensors")
        assert torch.equal(
            load_weights(
                tiny(seed=8, tie_word_embeddings=tied, value_embeds=value_embeds),
                tmp_path / f"dir{tied}{value_embeds}",
            ).lm_head.weight,
            model.lm_head.weight,
        )
        ids = torch.randint(0, 8192, (1, 8))
        assert torch.equal(fresh(ids), model(ids))
        assert (fresh.lm_head.weight is fresh.model.embed_tokens.weight) is tied


def test_unwrap_strips_ddp_and_compile_wrappers(tmp_path) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = tiny()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = torch.compile(DistributedDataParallel(model))
        assert unwrap(wrapped) is model
        keys = load_file(save_weights(wrapped, tmp_path / "ddp.safetensors"))
        assert set(keys) == set(load_file(save_weights(model, tmp_path / "plain.safetensors")))
    finally:
        dist.destroy_process_group()


def test_load_weights_refuses_a_mismatched_model_and_pickles(tmp_path) -> None:
    path = save_weights(tiny(), tmp_path / "w.safetensors")
    with pytest.raises(ValueError, match="Build the model with the config the weights were saved with"):
        load_weights(tiny(intermediate_size=128), path)
    (tmp_path / "w.pt").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="only safetensors"):
        load_weights(tiny(), tmp_path / "w.pt")
    with pytest.raises(FileNotFoundError):
        load_weights(tiny(), tmp_path / "missing.safetensors")


def test_compiled_model_matches_eager_without_graph_breaks(compiled_pair) -> None:
    model, compiled = compiled_pair
    ids = torch.randint(0, 8192, (2, 32))
    torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)
    for mask in (None, torch.ones_like(ids)):
        explanation = torch._dynamo.explain(model)(ids, mask)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1


@pytest.mark.parametrize("value_embeds", [0, 1])
def test_one_full_graph_for_every_shape_mask_and_length(value_embeds: int) -> None:
    """fullgraph=True turns any graph break into an error; the eager backend keeps it cheap (no inductor)."""
    torch._dynamo.reset()
    model = tiny(value_embeds=value_embeds)
    compiled = torch.compile(model, dynamic=True, fullgraph=True, backend="eager")
    for batch, seq in ((4, 32), (3, 17), (1, 1)):
        ids = torch.randint(0, 8192, (batch, seq))
        mask = torch.ones_like(ids)
        mask[0, : seq // 2] = 0
        torch.testing.assert_close(compiled(ids), model(ids), rtol=0, atol=1e-5)
        torch.testing.assert_close(compiled(ids, mask), model(ids, mask), rtol=0, atol=1e-5)


def test_state_dict_of_compiled_model_loads_into_plain_model(compiled_pair, tmp_path) -> None:
    model, compiled = compiled_pair
    assert unwrap(compiled) is model
    path = save_weights(compiled, tmp_path / "compiled.safetensors")
    assert not any(key.startswith("_orig_mod.") for key in load_file(path))
    fresh = tiny(seed=5)
    load_weights(fresh, path)
    ids = torch.randint(0, 8192, (2, 16))
    assert torch.equal(fresh(ids), model(ids))


def test_load_weights_into_compiled_model_is_refused(compiled_pair, tmp_path) -> None:
    model, compiled = compiled_pair
    path = save_weights(model, tmp_path / "w.safetensors")
    message = (
        "load weights into the plain module before torch.compile "
        "(call load_weights(model, ...) then torch.compile(model))"
    )
    with pytest.raises(TypeError) as error:
        load_weights(compiled, path)
    assert str(error.value) == message
