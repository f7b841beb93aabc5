"""`checkpoint_dir: s3://bucket/prefix` against a real S3-compatible server (moto's server mode on
127.0.0.1, as s3fs's own tests use; reached over HTTP through s3fs): a run whose node-local directory is
lost resumes from the bucket exactly, `init_from` and consolidation read a checkpoint from it, a step
without its manifest is never taken, and a damaged one is skipped (tasks/training/storage.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model import get_preset
from synthetic import model_ref, pattern_blocks, write_packed_dataset
from tasks.init_from.parent_cache import weights_sha256
from tasks.refs import DatasetRef, ModelRef
from tasks.training import TrainingInputError, TrainSettings, fit, read_metrics
from tasks.training.faults import ENV_VAR
from tasks.training.storage import local_run_dir, mirror_dir, pull_newest

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

VOCAB, SEQ = 96, 16
URL = "s3://llamaflow-test/runs/tiny"


@pytest.fixture(scope="module")
def s3() -> Iterator[object]:
    """The S3 endpoint, a bucket, and the environment every process (the ranks too) reaches it with."""
    import s3fs

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "NO_PROXY": "127.0.0.1",
    }
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()  # filesystems are cached by arguments, not by environment
    fs = s3fs.S3FileSystem()
    fs.mkdir("llamaflow-test")
    try:
        yield fs
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> DatasetRef:
    return write_packed_dataset(
        tmp_path_factory.mktemp("packed"),
        pattern_blocks(48, SEQ, VOCAB, 7),
        pattern_blocks(4, SEQ, VOCAB, 9),
        vocab_size=VOCAB,
    )


@pytest.fixture(scope="module")
def tiny() -> ModelRef:
    return model_ref(get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=SEQ), seed=0)


def settings() -> TrainSettings:
    return TrainSettings(
        micro_batch_size=2,
        accumulate_steps=2,
        max_steps=6,
        checkpoint_every=2,
        keep_checkpoints=2,
        lr=3e-3,
        warmup_steps=1,
        compile=False,
        dtype="fp32",
        device="cpu",
    )  # type: ignore[call-arg]


@pytest.mark.e2e
def test_a_run_in_a_bucket_resumes_exactly_on_a_host_that_lost_its_disk_and_init_from_reads_it(
    tmp_path: Path,
    s3: object,
    dataset: DatasetRef,
    tiny: ModelRef,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tasks.init_from import resolve_init_from
    from tasks.training import consolidate

    monkeypatch.setenv("LLAMAFLOW_HOME", str(tmp_path / "home"))
    whole = fit(tiny, dataset, settings(), tmp_path / "local", progress=False)

    monkeypatch.setenv(ENV_VAR, "crash_at_step=5")  # fails before step 5: step 4 is the newest checkpoint
    with pytest.raises(RuntimeError, match="injected crash before step 5"):
        fit(tiny, dataset, settings(), URL, progress=False)
    monkeypatch.delenv(ENV_VAR)
    shutil.rmtree(mirror_dir(URL))  # another host, or this one with its local disk wiped: only the bucket
    resumed = fit(tiny, dataset, settings(), URL, progress=False)

    assert resumed.step == 6 and Path(resumed.run_dir) == mirror_dir(URL)
    lines = [json.loads(line) for line in (mirror_dir(URL) / "metrics.jsonl").read_text().splitlines()]
    events = [line["event"] for line in lines if "event" in line]
    assert {"resumed_from": str(mirror_dir(URL) / "step_000004"), "step": 4} in events  # from the bucket
    assert [line["step"] for line in lines if "step" in line] == [1, 2, 3, 4, 5, 6]  # none trained twice
    logged, reference = read_metrics(resumed.run_dir), read_metrics(whole.run_dir)
    for step in range(1, 7):  # steps 1-4 from the bucket's metrics.jsonl, 5-6 trained again: bit for bit
        for name in ("train/loss", "train/grad_norm"):
            assert logged[step][name] == reference[step][name], (step, name)
    final = Path(resumed.path) / "model.safetensors"
    same = load_file(str(Path(whole.path) / "model.safetensors"))
    assert all(torch.equal(tensor, same[name]) for name, tensor in load_file(str(final)).items())
    listed = s3.ls("llamaflow-test/runs/tiny", detail=False, refresh=True)  # type: ignore[attr-defined]
    steps = sorted(p.rsplit("/", 1)[-1] for p in listed if "/step_" in p)
    assert steps == ["step_000004", "step_000006"]  # keep_checkpoints=2, pruned in the bucket too
    manifest = json.loads(s3.cat_file("llamaflow-test/runs/tiny/step_000006/manifest.json"))  # type: ignore[attr-defined]
    assert manifest["step"] == 6 and "optimizer/" in "".join(manifest["sha256"])

    # A new run started from the bucket's checkpoint: its weights, checked against the manifest.
    parent = resolve_init_from(f"{URL}/step_000006")
    assert (
        parent.weights_sha256
        == weights_sha256(final)
        == weights_sha256(Path(whole.path) / "model.safetensors")
    )
    with pytest.raises(TrainingInputError, match=f"give one of its checkpoints \\({URL}/step_000006\\)"):
        resolve_init_from(URL)
    capsys.readouterr()
    consolidate.main([f"{URL}/step_000006"])  # a whole checkpoint: its model.safetensors, put back as it is
    assert capsys.readouterr().out.strip() == f"{URL}/step_000006/model.safetensors"


def test_the_store_gives_only_published_steps_and_skips_a_damaged_one(
    tmp_path: Path, s3: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a pull takes: the newest step whose manifest is in the bucket and whose files match it."""
    monkeypatch.setenv("LLAMAFLOW_HOME", str(tmp_path / "home"))
    url, root = "s3://llamaflow-test/runs/pull", "llamaflow-test/runs/pull"
    for step in (2, 4):
        files = {
            "trainer_state.pt": b"state",
            "config.json": b"{}",
            "train_settings.json": b"{}",
            "model.safetensors": b"weights %d" % step,
            "optimizer/shard.safetensors": b"moments",
            "rng_rank_0.pt": b"rng",
        }
        for name, data in files.items():
            s3.pipe(f"{root}/step_{step:06d}/{name}", data)  # type: ignore[attr-defined]
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
        manifest = json.dumps({"step": step, "sha256": digests}).encode()
        s3.pipe(f"{root}/step_{step:06d}/manifest.json", manifest)  # type: ignore[attr-defined]
    s3.pipe(f"{root}/step_000006/model.safetensors", b"an upload killed before its manifest")  # type: ignore[attr-defined]

    run_dir = local_run_dir(url)
    assert pull_newest(run_dir) == run_dir / "step_000004"  # step 6 has no manifest: never taken
    assert (run_dir / "step_000004" / "model.safetensors").read_bytes() == b"weights 4"
    assert pull_newest(run_dir) is None  # nothing newer than the mirror's

    s3.pipe(f"{root}/step_000004/model.safetensors", b"weights 4, damaged")  # type: ignore[attr-defined]
    shutil.rmtree(run_dir)
    with pytest.warns(RuntimeWarning, match="step_000004: model.safetensors does not match"):
        assert pull_newest(local_run_dir(url)) == run_dir / "step_000002"
    assert not (run_dir / "step_000004").exists()

    with pytest.raises(TrainingInputError, match="bucket 'no-such-bucket' not found or not readable"):
        local_run_dir("s3://no-such-bucket/runs/x")
    with pytest.raises(TrainingInputError, match="carries credentials"):
        local_run_dir("s3://KEY:SECRET@llamaflow-test/runs/x")
