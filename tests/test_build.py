"""build_model: checkpoint weights are loaded into the plain module, and only then compiled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model import (
    LlamaConfig,
    LlamaForPretraining,
    get_preset,
    load_pretrained,
    load_weights,
    save_weights,
    unwrap,
    weights_file,
)
from tasks.build import build_model
from tasks.init_from import resolve_init_from


def _trained_looking_checkpoint(tmp_path: Path) -> tuple[LlamaConfig, Path]:
    config = get_preset("tiny", vocab_size=512)
    torch.manual_seed(7)
    model = LlamaForPretraining(config)
    with torch.no_grad():  # move away from the seed-0 initialisation build_model would produce
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_weights(model, ckpt / "model.safetensors")
    return config, ckpt


def test_checkpoint_is_loaded_before_compile(tmp_path: Path) -> None:
    config, ckpt = _trained_looking_checkpoint(tmp_path)
    ref = build_model(config, seed=0, parent=resolve_init_from(str(ckpt)))

    plain = load_pretrained(ref.path, ckpt).eval()
    compiled = torch.compile(load_pretrained(ref.path).eval())
    batch = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = plain(batch)
        got = compiled(batch)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # and the weights really are the checkpoint's, not a fresh initialisation
    reference = LlamaForPretraining(get_preset("tiny", vocab_size=512))
    load_weights(reference, ckpt / "model.safetensors")
    for (name, a), b in zip(
        unwrap(compiled).state_dict().items(), reference.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_loading_into_a_compiled_model_is_refused(tmp_path: Path) -> None:
    config, ckpt = _trained_looking_checkpoint(tmp_path)
    compiled = torch.compile(LlamaForPretraining(get_preset("tiny", vocab_size=512)))
    with pytest.raises(Exception, match="before torch.compile"):
        load_weights(compiled, ckpt / "model.safetensors")


def test_build_model_is_deterministic_and_cached(tmp_path: Path) -> None:
    config = get_preset("tiny", vocab_size=512)
    a = build_model(config, seed=3)
    b = build_model(config, seed=3)
    c = build_model(config, seed=4)
    assert a == b and a.fingerprint != c.fingerprint
    assert a.n_params > 0


def test_init_from_a_checkpoint_of_another_shape_is_a_clear_error(tmp_path: Path) -> None:
    _, ckpt = _trained_looking_checkpoint(tmp_path)
    other = get_preset("tiny", vocab_size=512, hidden_size=128)
    with pytest.raises(ValueError, match="do not fit this model"):
        build_model(other, seed=0, parent=resolve_init_from(str(ckpt)))


def test_weights_must_be_safetensors(tmp_path: Path) -> None:
    pickled = tmp_path / "weights.pt"
    torch.save({"x": torch.zeros(1)}, pickled)
    with pytest.raises(ValueError, match="no pickles"):
        weights_file(pickled)
