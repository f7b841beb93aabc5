"""The optimizer: parameter roles and groups, AdamW alone or Muon + AdamW, the LR schedule over groups,
state dicts, and Muon through the engine (exact accumulation, bit-for-bit resume, DDP, compiled)."""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook

from model import LlamaForPretraining, get_preset
from synthetic import eager_settings, pattern_blocks, write_packed_dataset
from synthetic import model_ref as build_model_ref
from tasks.refs import DatasetRef, ModelRef
from tasks.training import TrainSettings, fit, lr_at, read_metrics
from tasks.training.checkpoint import checkpoint_dirs
from tasks.training.optim import build_optimizer, parameter_roles

VOCAB = 96
SEQ = 16
PAD = 0
CPU = torch.device("cpu")


def tiny(**overrides: object) -> LlamaForPretraining:
    torch.manual_seed(0)
    return LlamaForPretraining(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ, **overrides))


def names(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> set[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {by_id[id(p)] for p in params}


@pytest.mark.parametrize(("tied", "value_embeds"), [(True, 0), (False, 0), (True, 1)])
def test_every_parameter_has_exactly_one_role(tied: bool, value_embeds: int) -> None:
    model = tiny(tie_word_embeddings=tied, value_embeds=value_embeds)
    roles = {role: names(model, params) for role, params in parameter_roles(model).items()}
    assert roles["hidden"] == {
        n for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("model.layers.")
    }
    tables = {f"model.value_embeds.{i}.weight" for i in range(value_embeds)}
    assert roles["embed"] == {"model.embed_tokens.weight"} | tables
    assert roles["head"] == (set() if tied else {"lm_head.weight"})
    assert roles["scalar"] == {n for n, p in model.named_parameters() if p.ndim == 1}
    every = [n for params in roles.values() for n in params]
    assert sorted(every) == sorted(n for n, _ in model.named_parameters())  # once each, tied counted once


def test_adamw_decays_matmul_weights_only_and_every_group_defaults_to_lr() -> None:
    model = tiny(tie_word_embeddings=False)
    opt = build_optimizer(model, TrainSettings(lr=1e-3, weight_decay=0.1), CPU)
    assert list(opt.parts) == ["adamw"]
    groups = opt.parts["adamw"].param_groups
    assert {g["lr"] for g in groups} == {1e-3}
    decayed = set().union(*(names(model, g["params"]) for g in groups if g["weight_decay"] == 0.1))
    not_decayed = set().union(*(names(model, g["params"]) for g in groups if g["weight_decay"] == 0.0))
    assert decayed == {n for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n}
    assert not_decayed == {"model.embed_tokens.weight"} | {
        n for n, p in model.named_parameters() if p.ndim == 1
    }
    assert opt.parts["adamw"].defaults["fused"] is True


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest_each_with_its_lr() -> None:
    model = tiny(tie_word_embeddings=False)
    settings = TrainSettings(
        optimizer="muon", lr=1e-3, embed_lr=2e-2, head_lr=4e-3, scalar_lr=5e-3, muon_lr=0.05, muon_ns_steps=4
    )
    opt = build_optimizer(model, settings, CPU)
    muon, adamw = opt.parts["muon"], opt.parts["adamw"]
    assert isinstance(muon, torch.optim.Muon)
    assert names(model, muon.param_groups[0]["params"]) == names(model, parameter_roles(model)["hidden"])
    assert muon.param_groups[0]["lr"] == 0.05 and muon.param_groups[0]["ns_steps"] == 4
    lr_of = {n: g["lr"] for g in adamw.param_groups for n in names(model, g["params"])}
    assert lr_of["model.embed_tokens.weight"] == 2e-2
    assert lr_of["lm_head.weight"] == 4e-3
    assert lr_of["model.norm.weight"] == 5e-3
    assert not set(lr_of) & names(model, muon.param_groups[0]["params"])

    opt.set_lr_scale(0.5)
    assert opt.lrs() == {"adamw": 2e-3, "muon": 0.025}  # head group first, then embed, scalar
    assert sorted(g["lr"] for g in opt.param_groups) == sorted([2e-3, 1e-2, 2.5e-3, 0.025])


def test_muon_weight_decay_shrinks_the_hidden_matrices_alone_by_the_scheduled_lr() -> None:
    model = tiny(tie_word_embeddings=False)
    settings = TrainSettings(optimizer="muon", lr=1e-3, weight_decay=0.0, muon_lr=0.05, muon_weight_decay=0.5)
    opt = build_optimizer(model, settings, CPU)
    hidden = names(model, parameter_roles(model)["hidden"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for param in model.parameters():
        param.grad = torch.zeros_like(param)  # no update: only the decoupled decay moves a weight
    opt.set_lr_scale(0.5)  # the decay follows the schedule: 1 - 0.025 * 0.5
    opt.step()
    for name, param in model.named_parameters():
        factor = 1 - 0.025 * 0.5 if name in hidden else 1.0
        torch.testing.assert_close(param.detach(), before[name] * factor, rtol=1e-6, atol=0, msg=name)


def test_state_dict_round_trip_and_a_mismatched_checkpoint_is_refused_by_name() -> None:
    model = tiny()
    opt = build_optimizer(model, TrainSettings(optimizer="muon"), CPU)
    model(torch.randint(0, VOCAB, (2, SEQ))).sum().backward()
    opt.step()
    state = opt.state_dict()
    assert set(state) == {"adamw", "muon"}
    assert all("momentum_buffer" in s for s in state["muon"]["state"].values())

    again = build_optimizer(model, TrainSettings(optimizer="muon"), CPU)
    again.load_state_dict(state)
    for a, b in zip(again.parts["muon"].state.values(), opt.parts["muon"].state.values(), strict=True):
        torch.testing.assert_close(a["momentum_buffer"], b["momentum_buffer"], rtol=0, atol=0)

    adamw_only = build_optimizer(model, TrainSettings(), CPU)
    with pytest.raises(
        ValueError, match=r"optimizer state for \['adamw', 'muon'\], this run builds \['adamw'\]"
    ):
        adamw_only.load_state_dict(state)
    # A bare AdamW state dict, as checkpoints held before Muon, still loads into the AdamW part.
    adamw_only.load_state_dict(build_optimizer(model, TrainSettings(), CPU).parts["adamw"].state_dict())


# ---------------------------------------------------------------- Muon through the engine


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    blocks = pattern_blocks(29, SEQ, VOCAB, 0)
    rng = np.random.default_rng(100)
    for row in range(0, 29, 3):  # uneven padding: micro-batches hold different token counts
        blocks[row, rng.integers(2, SEQ) :] = PAD
    return write_packed_dataset(
        tmp_path_factory.mktemp("packed"), blocks, pattern_blocks(4, SEQ, VOCAB, 1), vocab_size=VOCAB
    )


@pytest.fixture(scope="module")
def model_ref() -> ModelRef:
    return build_model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ), seed=0)


muon_settings = partial(
    eager_settings, optimizer="muon", epochs=2.0, embed_lr=1e-2, muon_lr=0.04, warmup_steps=2, device="cpu"
)


def weights(path: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


def losses(run_dir: str | Path) -> list[float]:
    return [m["train/loss"] for _, m in sorted(read_metrics(run_dir).items())]


def assert_same_training(a_path: str, b_path: str, model_ref: ModelRef, rel: float) -> None:
    """Both runs moved every tensor from the initial weights alike: |a - b| <= rel * |a - init| (norms)."""
    a, b, init = weights(a_path), weights(b_path), weights(model_ref.path)
    assert a.keys() == b.keys()
    for name in a:
        moved = float((a[name] - init[name]).norm())
        assert moved > 0, f"{name} did not train"
        assert float((a[name] - b[name]).norm()) <= rel * moved, name


# Muon's Newton-Schulz iteration runs in bf16 with a slope of ~3.4 at zero per iteration: float32
# summation-order differences between two equal gradients come out of it as differences of a few percent
# in the update's small singular directions. So equal training is checked where it is exact, on the
# gradients Muon receives, and loosely on what follows from them.
MUON_TOLERANCE = {"loss_rtol": 5e-3, "weights_rel": 0.25}


class MuonGradients:
    """Records the gradients torch.optim.Muon receives at each of its steps (in this process), and the LR
    its parameter group holds then."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = []
        self.lrs: list[float] = []

    def __enter__(self) -> MuonGradients:
        def hook(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
            if isinstance(optimizer, torch.optim.Muon):
                self.steps.append([p.grad.detach().clone() for p in optimizer.param_groups[0]["params"]])
                self.lrs.append(optimizer.param_groups[0]["lr"])

        self.handle = register_optimizer_step_pre_hook(hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()


def test_muon_with_accumulation_matches_one_big_micro_batch(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef
) -> None:
    with MuonGradients() as split_grads:
        split = fit(model_ref, dataset, muon_settings(), tmp_path / "k_by_b", progress=False)
    with MuonGradients() as whole_grads:
        whole = fit(
            model_ref,
            dataset,
            muon_settings(micro_batch_size=8, accumulate_steps=1),
            tmp_path / "kb",
            progress=False,
        )
    assert split.step == whole.step == 8 == len(split_grads.steps) == len(whole_grads.steps)
    for a, b in zip(split_grads.steps[0], whole_grads.steps[0], strict=True):  # same weights, same batch
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(losses(split.run_dir), losses(whole.run_dir), rtol=MUON_TOLERANCE["loss_rtol"])
    assert_same_training(split.path, whole.path, model_ref, MUON_TOLERANCE["weights_rel"])
    # The LR Muon's parameter group applied follows the schedule with Muon's own peak, and it is what the
    # run logged (warmup 2 of 8 steps, cosine to 0.1 of the peak).
    expected = [lr_at(step, lr=0.04, total_steps=8, warmup_steps=2, min_lr_ratio=0.1) for step in range(8)]
    assert split_grads.lrs == pytest.approx(expected, rel=1e-12)
    logged = read_metrics(split.run_dir)
    assert [logged[s]["train/muon_lr"] for s in range(1, 9)] == split_grads.lrs


def test_muon_resume_reproduces_the_run_bit_for_bit(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef
) -> None:
    run, run_dir = muon_settings(checkpoint_every=4, keep_checkpoints=2), tmp_path / "run"
    first = fit(model_ref, dataset, run, run_dir, progress=False)
    reference = losses(run_dir)
    assert [s for s, _ in checkpoint_dirs(run_dir)] == [4, 8]
    shutil.rmtree(first.path)  # steps 5..8 retrain from step 4: Muon's momentum must come back exactly
    resumed = fit(model_ref, dataset, run, run_dir, progress=False)
    assert resumed.step == 8
    assert losses(run_dir) == reference
    straight = fit(model_ref, dataset, run, tmp_path / "straight", progress=False)
    resumed_weights = weights(resumed.path)
    for name, tensor in weights(straight.path).items():
        torch.testing.assert_close(resumed_weights[name], tensor, rtol=0, atol=0)


def test_muon_on_two_gloo_ranks_equals_one_process(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef
) -> None:
    ddp = fit(
        model_ref,
        dataset,
        muon_settings(epochs=1.0, accumulate_steps=2, nproc_per_node=2),
        tmp_path / "ddp",
        progress=False,
    )
    single = fit(model_ref, dataset, muon_settings(epochs=1.0), tmp_path / "single", progress=False)
    assert ddp.step == single.step == 4
    np.testing.assert_allclose(losses(ddp.run_dir), losses(single.run_dir), rtol=MUON_TOLERANCE["loss_rtol"])
    assert_same_training(ddp.path, single.path, model_ref, MUON_TOLERANCE["weights_rel"])


def test_muon_compiled_bf16_trains_like_eager(
    tmp_path: Path, dataset: DatasetRef, model_ref: ModelRef
) -> None:
    compiled = fit(
        model_ref, dataset, muon_settings(compile=True, dtype="bf16"), tmp_path / "compiled", progress=False
    )
    eager = fit(model_ref, dataset, muon_settings(dtype="bf16"), tmp_path / "eager", progress=False)
    np.testing.assert_allclose(losses(compiled.run_dir), losses(eager.run_dir), rtol=2e-2)
    assert compiled.metrics["recompiles"] == 0
    assert losses(compiled.run_dir)[-1] < losses(compiled.run_dir)[0] - 0.3  # it learns
