"""FSDP2 (`data_parallel="fsdp"`) through `fit` and real torchrun/gloo ranks: it trains as one process with
the same global batch, its sharded checkpoints resume bit for bit at the same shape and exactly at any other
world size or mode (2 FSDP ranks -> 1 process; -> 2 DDP ranks -> 3 FSDP ranks with activation
checkpointing), its checkpoints hold every rank's slices and no gathered model, the model.safetensors
consolidated from them is what a one-process run writes, and it reduces gradients every micro-batch (or
once per optimizer step)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from model import get_preset, load_pretrained
from model.hf import export_hf
from model.weights import read_metadata
from synthetic import model_ref, pattern_blocks, write_packed_dataset
from tasks.init_from.local import resolve_local
from tasks.refs import DatasetRef, ModelRef
from tasks.training import TrainingError, TrainSettings, consolidate, fit, read_metrics
from tasks.training.checkpoint import checkpoint_dirs, checkpoint_problem
from tasks.training.checkpoint_weights import whole_weights
from tasks.training.faults import ENV_VAR
from tasks.training.metrics import METRICS_FILE

VOCAB = 96
SEQ = 16
PAD = 0
GLOBAL_BATCH = 12  # 2 blocks per micro-batch: 6 micro-batches in one process, 3 x 2 ranks, 2 x 3 ranks
RTOL = 1e-5  # fp32, no compile: only the order of float sums differs


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    blocks = pattern_blocks(72, SEQ, VOCAB, 7)
    rng = np.random.default_rng(8)
    for row in range(0, 72, 5):  # uneven padding: ranks and micro-batches hold different token counts
        blocks[row, rng.integers(2, SEQ) :] = PAD
    return write_packed_dataset(
        tmp_path_factory.mktemp("packed"), blocks, pattern_blocks(4, SEQ, VOCAB, 9), vocab_size=VOCAB
    )


@pytest.fixture(scope="module")
def tiny() -> ModelRef:
    return model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ), seed=0)


def run_settings(nproc: int, mode: str = "fsdp", **overrides: object) -> TrainSettings:
    base: dict[str, object] = dict(
        micro_batch_size=2,
        accumulate_steps=GLOBAL_BATCH // 2 // nproc,
        nproc_per_node=nproc,
        data_parallel=mode,
        max_steps=6,
        checkpoint_every=2,
        keep_checkpoints=3,
        lr=3e-3,
        warmup_steps=1,
        compile=False,
        dtype="fp32",
        device="cpu",
    )
    base.update(overrides)
    return TrainSettings(**base)  # type: ignore[arg-type]


def curve(run_dir: str | Path, name: str, steps: range) -> list[float]:
    logged = read_metrics(run_dir)
    return [logged[s][name] for s in steps]


def assert_same_curves(run_dir: str | Path, reference: str | Path, steps: range) -> None:
    for name in ("train/loss", "train/grad_norm"):
        np.testing.assert_allclose(
            curve(run_dir, name, steps), curve(reference, name, steps), rtol=RTOL, err_msg=name
        )


def records_of_step(run_dir: str | Path, step: int) -> list[Mapping[str, float]]:
    """Every metrics.jsonl record of `step` (a resumed run logs the steps after its checkpoint again)."""
    lines = (Path(run_dir) / METRICS_FILE).read_text().splitlines()
    return [r["metrics"] for r in map(json.loads, lines) if r.get("step") == step]


def resume_copy(source: str | Path, target: Path, step: int) -> Path:
    """A copy of run directory `source` whose newest checkpoint is that of `step`, without its metrics."""
    shutil.copytree(source, target)
    (target / METRICS_FILE).unlink()
    for later, path in checkpoint_dirs(target):
        if later > step:
            shutil.rmtree(path)
    return target


def test_fsdp_on_two_ranks_trains_as_one_process_and_resumes_at_any_world_size(
    tmp_path: Path,
    dataset: DatasetRef,
    tiny: ModelRef,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    single = fit(tiny, dataset, run_settings(1), tmp_path / "single", progress=False)

    # Two FSDP2 ranks, killed -9 right after step 5 (step 4 is the newest checkpoint); the rerun resumes.
    monkeypatch.setenv(ENV_VAR, "kill_at_step=5")
    with pytest.raises(TrainingError, match="torchrun with 2 workers failed"):
        fit(tiny, dataset, run_settings(2), tmp_path / "fsdp", progress=False)
    monkeypatch.delenv(ENV_VAR)
    fsdp = fit(tiny, dataset, run_settings(2), tmp_path / "fsdp", progress=False)
    assert fsdp.step == single.step == 6 and fsdp.tokens_seen == single.tokens_seen
    assert_same_curves(fsdp.run_dir, single.run_dir, range(1, 7))
    first, again = records_of_step(fsdp.run_dir, 5)
    assert (first["train/loss"], first["train/grad_norm"]) == (again["train/loss"], again["train/grad_norm"])
    step4 = Path(fsdp.run_dir) / "step_000004"
    shards = sorted(p.name for p in (step4 / "optimizer").iterdir())
    assert len(shards) == 2, shards  # every rank wrote its own optimizer shard
    assert checkpoint_problem(step4) is None
    # Nothing gathered: the model as every rank's slices, no whole file until one is needed.
    assert len(list((step4 / "model_shards").glob("*.safetensors"))) == 2
    assert not (step4 / "model.safetensors").exists() and not (Path(fsdp.path) / "model.safetensors").exists()
    with pytest.raises(FileNotFoundError, match=f"python -m tasks.training.consolidate {step4}"):
        load_pretrained(step4)  # a reader that needs the file is told how to write it
    started_from = resolve_local(str(step4), step4)  # init_from a sharded checkpoint consolidates it once
    assert (step4 / "model.safetensors").is_file() and started_from.weights_sha256

    # The registered weights, consolidated from the slices: the original module's whole state dict, as
    # one process writes it (names, dtypes, shapes, metadata).
    capsys.readouterr()
    consolidate.main([fsdp.path])  # `python -m tasks.training.consolidate STEP_DIR`, in this process
    whole = Path(capsys.readouterr().out.strip())
    assert whole == Path(fsdp.path) / "model.safetensors" and whole_weights(Path(fsdp.path)) == whole
    a, b = load_file(str(whole)), load_file(str(Path(single.path) / "model.safetensors"))
    assert read_metadata(whole) == read_metadata(Path(single.path) / "model.safetensors")
    assert {k: (v.dtype, v.shape) for k, v in a.items()} == {k: (v.dtype, v.shape) for k, v in b.items()}
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)
    load_pretrained(fsdp.path)
    export_hf(load_pretrained(fsdp.path), tmp_path / "hf")

    # Step 2 of the FSDP run resumed by one process (the plain module, the same global batch).
    one = fit(tiny, dataset, run_settings(1), resume_copy(fsdp.run_dir, tmp_path / "one", 2), progress=False)
    assert one.step == 6
    assert_same_curves(one.run_dir, single.run_dir, range(3, 7))

    # Step 2 resumed by two DDP ranks (stopped after step 4), whose step 4 three FSDP ranks finish.
    chain = resume_copy(fsdp.run_dir, tmp_path / "chain", 2)
    monkeypatch.setenv(ENV_VAR, "crash_at_step=5")
    with pytest.raises(TrainingError, match="torchrun with 2 workers failed"):
        fit(tiny, dataset, run_settings(2, "ddp"), chain, progress=False)
    monkeypatch.delenv(ENV_VAR)
    assert [s for s, _ in checkpoint_dirs(chain)] == [2, 4]
    # With activation checkpointing, which recomputes each block's forward in the backward pass: the same.
    three = fit(tiny, dataset, run_settings(3, activation_checkpointing="full"), chain, progress=False)
    assert three.step == 6
    assert len(list((Path(three.path) / "optimizer").iterdir())) == 3
    assert_same_curves(chain, single.run_dir, range(3, 7))


def test_hsdp_on_four_ranks_trains_as_one_process_and_resumes_through_the_same_checkpoints(
    tmp_path: Path, dataset: DatasetRef, tiny: ModelRef, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HSDP on a 2 x 2 mesh (two replicas of a model sharded over two ranks, as two nodes of two GPUs):
    the one-process curves within 1e-5, killed and resumed bit for bit from its own DCP checkpoints, whose
    slices are written once (not once per replica) and resume a one-process run."""
    hsdp = dict(micro_batch_size=1, accumulate_steps=3, hsdp_shard_size=2)  # 1 x 3 x 4 ranks = 12
    single = fit(tiny, dataset, run_settings(1), tmp_path / "single", progress=False)
    monkeypatch.setenv(ENV_VAR, "kill_at_step=5")
    with pytest.raises(TrainingError, match="torchrun with 4 workers failed"):
        fit(tiny, dataset, run_settings(4, "hsdp", **hsdp), tmp_path / "hsdp", progress=False)
    monkeypatch.delenv(ENV_VAR)
    done = fit(tiny, dataset, run_settings(4, "hsdp", **hsdp), tmp_path / "hsdp", progress=False)
    assert done.step == 6 and done.tokens_seen == single.tokens_seen
    assert_same_curves(done.run_dir, single.run_dir, range(1, 7))
    first, again = records_of_step(done.run_dir, 5)
    assert (first["train/loss"], first["train/grad_norm"]) == (again["train/loss"], again["train/grad_norm"])
    step2 = Path(done.run_dir) / "step_000002"
    assert checkpoint_problem(step2) is None and len(list((step2 / "optimizer").iterdir())) == 4
    shards = step2 / "model_shards"
    assert (
        sum(f.stat().st_size for f in shards.glob("*.safetensors"))
        < 1.2 * (Path(single.path) / "model.safetensors").stat().st_size
    )  # each slice once: the replicas are not written twice
    one = fit(tiny, dataset, run_settings(1), resume_copy(done.run_dir, tmp_path / "one", 2), progress=False)
    assert_same_curves(one.run_dir, single.run_dir, range(3, 7))


def test_hsdp_refuses_a_world_that_does_not_divide_into_shard_groups() -> None:
    with pytest.raises(ValueError, match="set hsdp_shard_size to a divisor of 6"):
        run_settings(3, "hsdp", nnodes=2, hsdp_shard_size=4)
    with pytest.raises(ValueError, match="use data_parallel=fsdp with muon"):
        run_settings(2, "hsdp", optimizer="muon")
    assert run_settings(2, "hsdp", nnodes=3).hsdp_shard_size is None  # one node's ranks by default


@pytest.mark.parametrize(
    ("mode", "sync", "reductions_per_step", "all_reduces_per_step"),
    [
        ("fsdp", "every_micro_batch", 6, 0),
        ("fsdp", "last_micro_batch", 1, 0),
        # HSDP keeps the reduce-scattered shards until the all-reduce: the gradient is set once per step.
        ("hsdp", "every_micro_batch", 1, 1),
    ],
)
def test_fsdp_reduces_gradients_every_micro_batch_or_once_per_optimizer_step(
    tmp_path: Path,
    dataset: DatasetRef,
    tiny: ModelRef,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    sync: str,
    reductions_per_step: int,
    all_reduces_per_step: int,
) -> None:
    """By default each micro-batch's gradients are reduce-scattered into the sharded ones (no unsharded
    gradient kept between micro-batches); with fsdp_gradient_sync=last_micro_batch, set_requires_gradient_sync
    (False) on every micro-batch but the last (FSDP2 has no no_sync) reduces them once per optimizer step (a
    one-process gloo group: the engine applies FSDP2 whenever it runs in a process group, as under torchrun).
    HSDP all-reduces each FSDP group's shards across the replicas once per optimizer step, not per micro-batch."""
    import types

    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives
    from torch.distributed.tensor import DTensor
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from tasks.training import engine
    from tasks.training.engine import run_process

    reductions: dict[int, int] = {}  # per parameter, since the last optimizer step
    per_step: list[set[int]] = []
    all_reduces = [0]  # FSDP2's all-reduces across replicas, since the last optimizer step
    per_step_all_reduces: list[int] = []
    groups = [0]

    def counting_all_reduce(*args: object, **kwargs: object) -> object:
        all_reduces[0] += 1
        return dist.all_reduce(*args, **kwargs)

    proxy = types.SimpleNamespace(**{n: getattr(dist, n) for n in dir(dist) if not n.startswith("__")})
    proxy.all_reduce = counting_all_reduce
    monkeypatch.setattr(_fsdp_collectives, "dist", proxy)

    def counting_build_optimizer(model: torch.nn.Module, *args: object) -> object:
        params = list(model.parameters())
        assert params and all(isinstance(p, DTensor) for p in params)  # the optimizer gets the shards
        groups[0] = sum(isinstance(m, FSDPModule) for m in model.modules())
        for i, param in enumerate(params):
            param.register_post_accumulate_grad_hook(
                lambda _, i=i: reductions.__setitem__(i, reductions.get(i, 0) + 1)
            )
        return build_optimizer(model, *args)

    def step_marker(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if isinstance(optimizer, torch.optim.AdamW):
            per_step.append(set(reductions.values()))
            reductions.clear()
            per_step_all_reduces.append(all_reduces[0])
            all_reduces[0] = 0

    build_optimizer = engine.build_optimizer
    monkeypatch.setattr(engine, "build_optimizer", counting_build_optimizer)
    handle = register_optimizer_step_pre_hook(step_marker)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        run = run_settings(
            1, mode, max_steps=2, checkpoint_every=0, fsdp_gradient_sync=sync
        )  # 6 micro-batches
        run_process(tiny, dataset, run, tmp_path / "run", progress=False)
    finally:
        dist.destroy_process_group()
        handle.remove()
    assert per_step == [{reductions_per_step}, {reductions_per_step}]
    assert groups[0] > 1 and per_step_all_reduces == [all_reduces_per_step * groups[0]] * 2


def test_activation_checkpointing_recomputes_each_block_and_trains_exactly_as_without_it(
    tmp_path: Path, dataset: DatasetRef, tiny: ModelRef
) -> None:
    from torch.nn.modules.module import register_module_forward_pre_hook

    from model.llama import DecoderLayer

    runs, block_forwards = {}, {"none": 0, "full": 0}
    for ac in ("none", "full"):
        # A pre-hook: the recomputation stops once it has what the backward needs (before the forward returns).
        def count(module: torch.nn.Module, args: object, ac: str = ac) -> None:
            block_forwards[ac] += isinstance(module, DecoderLayer)

        hook = register_module_forward_pre_hook(count)
        try:
            settings = run_settings(1, max_steps=2, activation_checkpointing=ac)
            runs[ac] = fit(tiny, dataset, settings, tmp_path / ac, progress=False)
        finally:
            hook.remove()
    assert block_forwards["full"] == 2 * block_forwards["none"] > 0  # each block's forward again in backward
    losses = {ac: curve(run.run_dir, "train/loss", range(1, 3)) for ac, run in runs.items()}
    assert losses["full"] == losses["none"]
    a, b = (load_file(str(Path(runs[ac].path) / "model.safetensors")) for ac in ("full", "none"))
    assert a.keys() == b.keys()  # no wrapper name in the saved weights
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)


def test_large_files_are_hashed_in_chunks_that_the_ranks_share(
    tmp_path: Path, dataset: DatasetRef, tiny: ModelRef, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file larger than a hash chunk gets one digest per chunk (so the ranks share one large file), and
    a change in any chunk, or a truncation, is caught."""
    from tasks.training import checkpoint

    monkeypatch.setattr(checkpoint, "HASH_CHUNK", 4096)
    done = fit(tiny, dataset, run_settings(1, max_steps=1), tmp_path / "run", progress=False)
    path = Path(done.path)
    digests = json.loads((path / "manifest.json").read_text())["sha256"]
    weights = path / "model.safetensors"
    assert len(digests["model.safetensors"]) == -(-weights.stat().st_size // 4096) > 2
    assert checkpoint_problem(path) is None
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle] ^= 1
    weights.write_bytes(bytes(data))
    assert "model.safetensors does not match" in (checkpoint_problem(path) or "")
    data[middle] ^= 1
    weights.write_bytes(bytes(data[:-4096]))
    assert "model.safetensors does not match" in (checkpoint_problem(path) or "")
    weights.write_bytes(bytes(data))
    assert checkpoint_problem(path) is None
