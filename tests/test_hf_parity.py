"""Logit parity with transformers.LlamaForCausalLM and the Hugging Face interchange (offline, float32)."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from model import LlamaForPretraining, export_hf, generate, get_preset, import_hf

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the 48-token test sequences reach the scaled and the smoothed frequency bands.
    "original_max_position_embeddings": 32,
}
CASES = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mqa_tied": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "llama3_rope": dict(num_key_value_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING),
    "head_dim_set": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=48),
}


def ours(case: str, seed: int = 0) -> LlamaForPretraining:
    torch.manual_seed(seed)
    config = get_preset("tiny", vocab_size=512, initializer_range=0.2, **CASES[case])
    return LlamaForPretraining(config).eval()


def hf_config(case: str) -> transformers.LlamaConfig:
    """The same architecture written directly as a transformers config (nothing is downloaded)."""
    ours_config = get_preset("tiny", vocab_size=512, **CASES[case])
    rope = {"rope_type": "default", "rope_theta": ours_config.rope_theta}
    if ours_config.rope_scaling:
        rope = {**ours_config.rope_scaling, "rope_theta": ours_config.rope_theta}
    return transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=ours_config.hidden_size,
        intermediate_size=ours_config.intermediate_size,
        num_hidden_layers=ours_config.num_hidden_layers,
        num_attention_heads=ours_config.num_attention_heads,
        num_key_value_heads=ours_config.num_key_value_heads,
        head_dim=ours_config.head_dim,
        max_position_embeddings=ours_config.max_position_embeddings,
        rms_norm_eps=ours_config.rms_norm_eps,
        tie_word_embeddings=ours_config.tie_word_embeddings,
        rope_parameters=rope,
        initializer_range=0.2,
    )


def load_hf(path: Path, attn: str = "sdpa") -> tuple[transformers.LlamaForCausalLM, dict, str]:
    """from_pretrained with its loading report and everything transformers logged meanwhile."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = transformers.logging.get_logger()
    logger.addHandler(handler)
    try:
        model, info = transformers.LlamaForCausalLM.from_pretrained(
            path, attn_implementation=attn, output_loading_info=True
        )
    finally:
        logger.removeHandler(handler)
    return model.eval(), info, stream.getvalue()


def assert_clean_load(info: dict, log: str) -> None:
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    for word in ("MISSING", "UNEXPECTED", "MISMATCH", "newly initialized", "not used"):
        assert word not in log, log


@pytest.mark.parametrize(("case", "attn"), [(case, "sdpa") for case in sorted(CASES)] + [("gqa", "eager")])
def test_our_export_loads_in_transformers_with_identical_logits(case: str, attn: str, tmp_path: Path) -> None:
    model = ours(case)
    export_hf(model, tmp_path)
    hf, info, log = load_hf(tmp_path, attn)
    assert_clean_load(info, log)
    assert hf.config.num_key_value_heads == model.config.num_key_value_heads
    ids = torch.randint(0, 512, (2, 48))
    # SDPA: the same kernel as transformers. The CPU default (matmul attention) sums in another order.
    for backend, tolerance in (("sdpa", 1e-5), ("auto", 1e-4)):
        model.attention_backend = backend
        with torch.no_grad():
            diff = (model(ids) - hf(ids).logits).abs().max().item()
        assert diff <= tolerance, f"{case}, {backend} attention: max abs logit difference {diff}"


@pytest.mark.parametrize("case", ["gqa", "mqa_tied", "llama3_rope"])
def test_transformers_checkpoint_imports_with_identical_logits(case: str, tmp_path: Path) -> None:
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(hf_config(case)).eval()
    hf.save_pretrained(tmp_path)
    model = import_hf(tmp_path)
    assert model.config.rope_scaling == CASES[case].get("rope_scaling")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is hf.config.tie_word_embeddings
    ids = torch.randint(0, 512, (3, 40))
    with torch.no_grad():
        reference = hf(ids).logits
        diff = (model(ids) - reference).abs().max().item()
    assert reference.abs().max() > 0.5  # large enough weights that a wrong layout could not hide
    assert diff <= 1e-5, f"{case}: max abs logit difference {diff}"


def test_padded_batch_matches_transformers_at_real_positions(tmp_path: Path) -> None:
    model = ours("gqa")
    export_hf(model, tmp_path)
    hf, _, _ = load_hf(tmp_path)
    ids = torch.randint(3, 512, (2, 20))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # left padding
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = model(ids, mask)
        b = hf(ids, attention_mask=mask, position_ids=position_ids).logits
    real = mask.bool()
    assert (a[real] - b[real]).abs().max() <= 1e-5


def test_export_import_round_trip_is_exact(tmp_path: Path) -> None:
    for case in ("gqa", "mqa_tied"):
        model = ours(case)
        export_hf(model, tmp_path / case)
        keys = set(load_file(tmp_path / case / "model.safetensors"))
        assert (
            "model.layers.0.self_attn.k_proj.weight" in keys and "model.layers.0.mlp.up_proj.weight" in keys
        )
        assert not any("qkv_proj" in k or "gate_up_proj" in k for k in keys)
        back = import_hf(tmp_path / case)
        assert back.config == model.config
        for (name, a), b in zip(model.state_dict().items(), back.state_dict().values(), strict=True):
            assert torch.equal(a, b), name
        ids = torch.randint(0, 512, (2, 30))
        assert torch.equal(back(ids), model(ids))


def test_bfloat16_export_declares_its_dtype(tmp_path: Path) -> None:
    export_hf(ours("gqa"), tmp_path, dtype=torch.bfloat16)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLM"]
    assert all(t.dtype == torch.bfloat16 for t in load_file(tmp_path / "model.safetensors").values())
    assert import_hf(tmp_path).model.norm.weight.dtype == torch.float32


def small_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = [Path(transformers.__file__).read_text()] * 3
    tokenizer.train_from_iterator(text, trainer=trainer)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def test_tokenizer_export_loads_with_auto_tokenizer(tmp_path: Path) -> None:
    tokenizer = small_tokenizer()
    model = ours("gqa")
    export_hf(model, tmp_path, tokenizer=tokenizer)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (auto.bos_token, auto.eos_token, auto.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (0, 1, 2)
    text = "def export(model):\n    return model"
    assert auto(text)["input_ids"] == tokenizer.encode(text).ids
    assert auto.decode(auto(text)["input_ids"]) == text
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 1, 2)
    # Also from a path to tokenizer.json.
    export_hf(model, tmp_path / "by_path", tokenizer=tmp_path / "tokenizer.json")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "by_path").eos_token_id == 1


def test_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path: Path) -> None:
    model = LlamaForPretraining(get_preset("tiny", vocab_size=300))
    with pytest.raises(ValueError, match="vocab_size is 300"):
        export_hf(model, tmp_path, tokenizer=small_tokenizer())


def test_import_refuses_pickles_and_other_architectures(tmp_path: Path) -> None:
    export_hf(ours("gqa"), tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pickled .bin files are refused"):
        import_hf(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(ValueError, match="only 'llama'"):
        import_hf(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        import_hf(tmp_path / "nowhere")


def test_greedy_generation_matches_transformers_generate(tmp_path: Path) -> None:
    model = ours("gqa")
    export_hf(model, tmp_path)
    hf, _, _ = load_hf(tmp_path)
    ids = torch.randint(3, 512, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    ids[1, :5] = 2
    mine = generate(model, ids, mask, max_new_tokens=10, temperature=0, pad_token_id=2)
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=2)
    assert torch.equal(mine, theirs)
    assert mine[:, 12:].unique().numel() > 2
