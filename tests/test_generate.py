"""Generation: KV cache equals full recomputation, left-padded batches equal single prompts, EOS, sampling."""

from __future__ import annotations

import pytest
import torch

from model import KVCache, LlamaForPretraining, generate, get_preset, sample_next

PAD, EOS = 2, 1
# Inductor imports torch.utils.mkldnn, which uses the deprecated torch.jit.script_method.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


@pytest.fixture(scope="module")
def model() -> LlamaForPretraining:
    # A large init spread makes a random model's greedy continuations varied rather than one repeated token.
    torch.manual_seed(0)
    return LlamaForPretraining(get_preset("tiny", vocab_size=512, initializer_range=0.3)).eval()


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def prompts(lengths=(11, 4, 7), seed: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=gen) for n in lengths]


def test_cached_equals_uncached_greedy_single_prompt(model: LlamaForPretraining) -> None:
    ids = prompts((9,))[0][None]
    cached = generate(model, ids, max_new_tokens=24, temperature=0)
    uncached = generate(model, ids, max_new_tokens=24, temperature=0, use_cache=False)
    assert cached.shape == (1, 33) and torch.equal(cached[:, :9], ids)
    assert torch.equal(cached, uncached)
    assert torch.equal(generate(model, ids, torch.ones_like(ids), max_new_tokens=24, temperature=0), cached)
    assert cached[0, 9:].unique().numel() > 3  # the check means something only if tokens vary


def test_cached_equals_uncached_with_left_padding(model: LlamaForPretraining) -> None:
    ids, mask = left_padded(prompts())
    cached = generate(model, ids, mask, max_new_tokens=20, temperature=0)
    uncached = generate(model, ids, mask, max_new_tokens=20, temperature=0, use_cache=False)
    assert torch.equal(cached, uncached)


def test_left_padded_batch_equals_each_prompt_alone(model: LlamaForPretraining) -> None:
    batch = prompts()
    ids, mask = left_padded(batch)
    together = generate(model, ids, mask, max_new_tokens=16, temperature=0)
    width = ids.shape[1]
    for row, prompt in enumerate(batch):
        alone = generate(model, prompt[None], max_new_tokens=16, temperature=0)
        assert torch.equal(together[row, width:], alone[0, len(prompt) :]), row


def test_rows_stop_at_eos_and_then_hold_pad(model: LlamaForPretraining) -> None:
    ids, mask = left_padded(prompts())
    free = generate(model, ids, mask, max_new_tokens=12, temperature=0)
    width = ids.shape[1]
    eos = int(free[0, width + 3])  # row 0 emits this token at its 4th step
    stopped = generate(model, ids, mask, max_new_tokens=12, temperature=0, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(stopped[0, : width + 4], free[0, : width + 4])
    assert (stopped[0, width + 4 :] == PAD).all()
    for row in (1, 2):
        new = free[row, width:]
        hits = (new == eos).nonzero()
        end = int(hits[0]) + 1 if len(hits) else len(new)
        assert torch.equal(stopped[row, width : width + end], new[:end])
        assert (stopped[row, width + end :] == PAD).all()


def test_generation_stops_early_when_all_rows_finished(model: LlamaForPretraining) -> None:
    ids = prompts((5,))[0][None]
    first = int(generate(model, ids, max_new_tokens=1, temperature=0)[0, -1])
    out = generate(model, ids, max_new_tokens=30, temperature=0, eos_token_id=first)
    assert out.shape == (1, 6) and out[0, -1] == first


def test_sampling_is_reproducible_and_respects_top_k_top_p(model: LlamaForPretraining) -> None:
    ids, mask = left_padded(prompts())

    def sample(seed: int, **kwargs) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return generate(model, ids, mask, max_new_tokens=12, generator=generator, **kwargs)

    assert torch.equal(sample(7, temperature=0.8), sample(7, temperature=0.8))
    assert not torch.equal(sample(7, temperature=1.5), sample(8, temperature=1.5))
    greedy = generate(model, ids, mask, max_new_tokens=12, temperature=0)
    assert torch.equal(sample(1, top_k=1), greedy)
    assert torch.equal(sample(1, top_p=1e-6), greedy)


def test_sample_next_keeps_only_the_allowed_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    top2 = sample_next(logits, top_k=2, generator=gen)
    assert set(top2.tolist()) == {0, 1}
    nucleus = sample_next(logits, top_p=0.7, generator=gen)  # 0.5 < 0.7, 0.5 + 0.3 covers it: {0, 1}
    assert set(nucleus.tolist()) == {0, 1}
    share = (nucleus == 0).float().mean().item()
    assert 0.57 < share < 0.68  # 0.5 / 0.8 renormalised
    assert set(sample_next(logits, temperature=0).tolist()) == {0}


def test_compiled_wrapper_and_bf16_autocast_generate(model: LlamaForPretraining) -> None:
    ids, mask = left_padded(prompts())
    plain = generate(model, ids, mask, max_new_tokens=6, temperature=0)
    assert torch.equal(generate(torch.compile(model), ids, mask, max_new_tokens=6, temperature=0), plain)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = generate(model, ids, mask, max_new_tokens=6, temperature=0)
    assert low.shape == plain.shape and low.dtype == torch.long


def test_bad_arguments_fail_before_any_work(model: LlamaForPretraining) -> None:
    ids, mask = left_padded(prompts())
    with pytest.raises(ValueError, match="left-padded"):
        generate(model, ids, mask.flip(1), max_new_tokens=4)
    with pytest.raises(ValueError, match="max_position_embeddings 512"):
        generate(model, ids, mask, max_new_tokens=510)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, ids, max_new_tokens=4, temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, ids, max_new_tokens=4, top_p=0)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, ids, max_new_tokens=4, top_k=0)
    with pytest.raises(ValueError, match=r"outside \[0, 512\)"):
        generate(model, ids + 600, max_new_tokens=4)
    assert torch.equal(generate(model, ids, max_new_tokens=0), ids)


def test_kv_cache_bounds(model: LlamaForPretraining) -> None:
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        KVCache(model.config, 1, 600)
    cache = KVCache(model.config, 1, 4)
    model(torch.tensor([[5, 6, 7]]), kv_cache=cache)
    assert cache.length == 3
    with pytest.raises(ValueError, match="KVCache overflow"):
        model(torch.tensor([[5, 6]]), kv_cache=cache)
