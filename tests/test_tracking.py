"""tasks.tracking (store, runs, sink, report) against a real, temporary SQLite MLflow store (the server case
is in test_register)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import mlflow
import numpy as np
import pytest

from tasks import home
from tasks.refs import DatasetRef
from tasks.tracking import report, store
from tasks.tracking.dataset_source import TAG_WEIGHT, PackedSplitSource
from tasks.tracking.sink import MlflowSink, start_system_metrics
from tasks.training.metrics import JsonlMetrics

SECRET = "s3cr3t-pw"


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One SQLite store for the module (creating one costs seconds); each test gets its own run."""
    root = tmp_path_factory.mktemp("tracking-store")
    uri = f"sqlite:///{root / 'mlruns' / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLAMAFLOW_MLRUNS", str(root / "mlruns"))
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        yield uri


@pytest.fixture()
def run_id(store_uri: str) -> str:
    return store.start_run("tracking-tests", run_name="unit", tags={"purpose": "test"})


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dataset(tmp_path: Path, fingerprint: str = "f" * 64) -> DatasetRef:
    directory = tmp_path / "packed-abc"
    directory.mkdir(parents=True)
    np.save(directory / "train.npy", np.zeros((10, 129), dtype=np.uint16))
    np.save(directory / "val.npy", np.zeros((2, 129), dtype=np.uint16))
    (directory / "meta.json").write_text("{}")
    return DatasetRef(
        path=str(directory),
        fingerprint=fingerprint,
        seq_len=128,
        vocab_size=512,
        train_blocks=10,
        val_blocks=2,
        train_tokens=1280,
        val_tokens=256,
        stats={"documents": 7, "corpus": "stdlib"},
    )


def test_run_lifecycle_and_experiment_location(store_uri: str, run_id: str) -> None:
    client = store.get_client()
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING"
    assert run.info.run_name == "unit"
    assert run.data.tags["purpose"] == "test"
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "tracking-tests"
    assert experiment.artifact_location.startswith(home.artifact_root())
    # Idempotent: the same name gives the same experiment.
    assert store.ensure_experiment("tracking-tests") == run.info.experiment_id

    store.end_run(run_id, "failed")
    assert store.run_status(run_id) == "FAILED"
    with pytest.raises(ValueError, match="not one of"):
        store.end_run(run_id, "DONE")


def test_runs_record_the_git_commit_of_the_code_whatever_the_entry_point(run_id: str) -> None:
    """MLflow looks for a git repository around sys.argv[0] (pytest here, a Prefect worker's engine in
    production); the commit must come from the code that trains."""
    head = subprocess.run(
        ["git", "-C", str(home.PROJECT_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    tags = store.get_client().get_run(run_id).data.tags
    assert tags.get("mlflow.source.git.commit") == head


def test_log_params_flattens_truncates_and_batches(run_id: str) -> None:
    long_value = "x" * 10_000
    params = {
        "model": {"hidden_size": 64, "rope_scaling": None, "nested": {"a": [1, 2]}},
        "lr": 3e-4,
        "notes": long_value,
        **{f"p{i:03d}": i for i in range(250)},  # more than one log_batch (100 params) worth
    }
    logged = store.log_params(run_id, params)
    stored = store.get_client().get_run(run_id).data.params
    assert stored == logged
    assert stored["model.hidden_size"] == "64"
    assert stored["model.rope_scaling"] == "null"
    assert stored["model.nested.a"] == "[1, 2]"
    assert stored["lr"] == "0.0003"
    assert len(stored["notes"]) == store.MAX_PARAM_VAL_LENGTH
    assert stored["notes"].endswith("[truncated]")
    assert stored["p249"] == "249"
    assert len(stored) == 255
    # A continued run logs its params again: the same values are fine, a changed one is kept as it was.
    with pytest.warns(RuntimeWarning, match="lr"):
        store.log_params(run_id, {**params, "lr": 1e-3, "new": 1})
    stored = store.get_client().get_run(run_id).data.params
    assert stored["lr"] == "0.0003" and stored["new"] == "1"


def test_training_and_validation_datasets_are_mlflow_data_inputs(run_id: str, tmp_path: Path) -> None:
    ref = _dataset(tmp_path)
    store.log_datasets(run_id, ref)
    store.log_datasets(run_id, ref)  # a continued run logs them again: still one input per context
    inputs = store.get_client().get_run(run_id).inputs.dataset_inputs
    by_context = {{t.key: t.value for t in i.tags}["mlflow.data.context"]: i.dataset for i in inputs}
    assert set(by_context) == {"training", "validation"} and len(inputs) == 2
    train, val = by_context["training"], by_context["validation"]
    assert train.digest == val.digest == ref.fingerprint[:36]
    assert (train.name, val.name) == ("packed-abc/train", "packed-abc/val")
    assert json.loads(train.profile)["features_shape"] == [10, 129]
    assert json.loads(val.profile)["features_shape"] == [2, 129]
    assert json.loads(train.schema)["mlflow_tensorspec"]["features"]
    # Where it came from names no path of this machine (tmp_path is outside the home: its name only).
    assert train.source_type == "llamaflow"
    assert json.loads(train.source) == {"path": "packed-abc/train.npy", "fingerprint": ref.fingerprint}
    assert str(tmp_path) not in train.source + val.source


def test_a_mixtures_sources_are_inputs_with_their_weights_and_tokens(run_id: str, tmp_path: Path) -> None:
    ref = _dataset(tmp_path)
    mixture = [  # as the data stage writes it (tests/test_data_mixture.py checks those values)
        {"source": "web/*.jsonl", "weight": 0.75, "fingerprint": "a" * 64, "stream_tokens": 900, "blocks": 9},
        {"source": "hf:code", "weight": 0.25, "fingerprint": "b" * 64, "stream_tokens": 100, "blocks": 3},
    ]
    for item in mixture:
        item.update(val_stream_tokens=50, val_blocks=1)
    (Path(ref.path) / "meta.json").write_text(json.dumps({"mixture": mixture}))
    store.log_datasets(run_id, ref)
    store.log_datasets(run_id, ref)  # a continued run: no second record
    inputs = store.get_client().get_run(run_id).inputs.dataset_inputs
    weighted = {i.dataset.name: i for i in inputs if any(t.key == TAG_WEIGHT for t in i.tags)}
    assert len(inputs) == 4 and set(weighted) == {"packed-abc/web/*.jsonl", "packed-abc/hf:code"}
    for item in mixture:
        recorded = weighted[f"packed-abc/{item['source']}"]
        tags = {t.key: t.value for t in recorded.tags}
        assert tags == {TAG_WEIGHT: repr(item["weight"]), "mlflow.data.context": "training"}
        profile = json.loads(recorded.dataset.profile)
        assert (profile["weight"], profile["stream_tokens"]) == (item["weight"], item["stream_tokens"])
        assert recorded.dataset.digest == item["fingerprint"][:36]
        assert str(tmp_path) not in recorded.dataset.source


def test_a_dataset_under_the_home_is_stored_relative_to_it(run_id: str) -> None:
    parent = f"datasets/tracking-test-{run_id}"
    # (MLflow keeps one source per experiment, dataset name and digest: another digest than the test above)
    ref = _dataset(home.home() / parent, fingerprint="e" * 64)
    store.log_datasets(run_id, ref)
    sources = [json.loads(i.dataset.source) for i in store.get_client().get_run(run_id).inputs.dataset_inputs]
    assert sorted(s["path"] for s in sources) == [
        f"$LLAMAFLOW_HOME/{parent}/packed-abc/train.npy",
        f"$LLAMAFLOW_HOME/{parent}/packed-abc/val.npy",
    ]
    assert PackedSplitSource.from_dict(sources[0]).load().startswith(str(home.home()))


def test_sink_logs_every_step_once_without_waiting_for_the_store(run_id: str) -> None:
    client = store.get_client()
    sink = MlflowSink(run_id)
    started = time.perf_counter()
    for step in range(1, 121):
        sink.log_metrics(
            {"train/loss": 10.0 - step * 0.05, "train/lr": 1e-3, "train/tokens_per_s": 5000.0}, step
        )
    per_step_ms = (time.perf_counter() - started) / 120 * 1000
    sink.close()
    history = sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(1, 121))
    assert history[6].value == 10.0 - 7 * 0.05
    print(f"MlflowSink overhead: {per_step_ms:.3f} ms/step (3 metrics, async logging, SQLite)")
    assert per_step_ms < 20, "logging must not wait for the store on the training thread"
    with pytest.raises(RuntimeError, match="closed"):
        sink.log_metrics({"train/loss": 1.0}, 121)


def test_a_resumed_sink_fills_what_the_store_missed_and_relogs_nothing(run_id: str, tmp_path: Path) -> None:
    """A killed run: metrics.jsonl (written synchronously by the engine) holds steps 1-9, MLflow got only
    1-3 and 5 (async logging in flight at the kill). The resumed run recomputes steps 7-12 from its step-6
    checkpoint."""
    client = store.get_client()
    losses = {step: 8.0 - step / 7 for step in range(1, 13)}
    jsonl = JsonlMetrics(tmp_path)
    for step in range(1, 10):
        jsonl.log_metrics({"train/loss": losses[step], "train/lr": 0.1}, step)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 10, "metr')  # torn by the kill
    first = MlflowSink(run_id)
    for step in (1, 2, 3, 5):
        first.log_metrics({"train/loss": losses[step], "train/lr": 0.1}, step)
    first.close()

    resumed = MlflowSink(run_id, run_dir=tmp_path)
    for step in range(7, 13):
        resumed.log_metrics({"train/loss": losses[step], "train/lr": 0.1}, step)
    resumed.close()
    for key in ("train/loss", "train/lr"):
        history = client.get_metric_history(run_id, key)
        assert sorted(m.step for m in history) == list(range(1, 13)), key
    assert {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")} == losses


def test_sink_retries_what_the_store_refused_and_fails_at_close(run_id: str) -> None:
    client = store.get_client()
    sink = MlflowSink(run_id)
    sink.log_metrics({"train/loss": 1.0}, 1)
    sink.flush()
    client.delete_run(run_id)  # the store now refuses writes to this run, like an outage would
    sink.log_metrics({"train/loss": 2.0}, 2)
    sink.flush()
    client.restore_run(run_id)
    sink.log_metrics({"train/loss": 3.0}, 3)
    sink.close()  # step 2 failed in the background and is written now
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == [1, 2, 3]

    again = MlflowSink(run_id)
    client.delete_run(run_id)
    again.log_metrics({"train/loss": 4.0}, 4)
    with pytest.raises(RuntimeError, match="1 metrics could not be written"):
        again.close()
    client.restore_run(run_id)


def test_a_sink_holds_what_a_refusing_store_missed_and_reads_back_what_it_dropped(
    run_id: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store refuses writes for 300 steps (the run is deleted: as an outage would); the sink holds at
    most `max_buffered` metrics, and the steps it dropped come back from metrics.jsonl when it closes."""
    client = store.get_client()
    jsonl = JsonlMetrics(tmp_path)
    sink = MlflowSink(run_id, run_dir=tmp_path)
    sink.max_buffered = 100
    client.delete_run(run_id)
    for step in range(1, 301):
        metrics = {"train/loss": 10.0 - step / 100, "train/lr": 0.1}
        jsonl.log_metrics(metrics, step)
        sink.log_metrics(metrics, step)
    assert not sink.flush(timeout_s=30)
    assert "dropped from memory" in caplog.text
    client.restore_run(run_id)
    sink.close(timeout_s=60)
    for key in ("train/loss", "train/lr"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == list(range(1, 301)), key


def test_sink_checks_the_run_and_store_up_front(store_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        MlflowSink("0" * 32)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(store.TrackingStoreUnavailable):
        MlflowSink("0" * 32)


def test_training_curves_from_the_engine_metrics_with_a_torn_last_line(run_id: str, tmp_path: Path) -> None:
    from tasks.training.metrics import read_metrics

    sink = JsonlMetrics(tmp_path)
    for s in range(1, 31):
        sink.log_metrics({"train/loss": 8 - s * 0.1, "train/lr": min(1.0, s / 5) * 1e-3}, s)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 31, "metr')  # a kill mid-line
    figure = report.training_curves_figure(read_metrics(tmp_path), val_loss=(30, 5.5))
    loss_axis, lr_axis = figure.axes
    assert [len(line.get_xdata()) for line in loss_axis.get_lines()] == [30, 1]
    assert lr_axis.get_lines()[0].get_ydata()[-1] == pytest.approx(1e-3)
    store.get_client().log_figure(run_id, figure, "loss_curve.png")
    local = store.get_client().download_artifacts(run_id, "loss_curve.png", str(tmp_path))
    assert Path(local).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no train/loss"):
        report.training_curves_figure({1: {"train/lr": 0.1}})


def test_samples_table(run_id: str, tmp_path: Path) -> None:
    report.log_samples(run_id, [("def ", "foo(x):"), ("class ", "Bar:")])
    local = store.get_client().download_artifacts(run_id, "samples.json", str(tmp_path))
    table = json.loads(Path(local).read_text())
    assert table["columns"] == ["prompt", "completion"]
    assert table["data"] == [["def ", "foo(x):"], ["class ", "Bar:"]]
    with pytest.raises(ValueError, match="No samples"):
        report.log_samples(run_id, [])


def test_run_link(store_uri: str, run_id: str) -> None:
    link = store.run_link(run_id)
    assert link.startswith(f"mlflow ui --backend-store-uri {store_uri}")
    assert run_id in link


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        (
            f"postgresql://llama:{SECRET}@db.internal:5432/mlflow",
            "postgresql://llama:***@db.internal:5432/mlflow",
        ),
        (
            f"postgresql+psycopg2://llama:{SECRET}@db/mlflow?sslmode=require",
            "postgresql+psycopg2://llama:***@db/mlflow?sslmode=require",
        ),
        (f"https://llama:{SECRET}@mlflow.example.com/", "https://llama:***@mlflow.example.com/"),
        (f"https://{SECRET}@mlflow.example.com", "https://***@mlflow.example.com"),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
        ("sqlite:////abs/mlflow.db", "sqlite:////abs/mlflow.db"),
    ],
)
def test_credentials_in_a_tracking_uri_are_redacted(uri: str, shown: str) -> None:
    assert store.redact_uri(uri) == shown


def test_closed_server_port_fails_fast_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    started = time.perf_counter()
    with pytest.raises(store.TrackingStoreUnavailable) as excinfo:
        store.start_run("never-created")
    assert time.perf_counter() - started < 5
    message = str(excinfo.value)
    assert uri in message
    assert "mlflow server" in message and "unset MLFLOW_TRACKING_URI" in message


def test_a_server_uri_with_credentials_is_probed_not_crashed_on_and_never_shown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(name, raising=False)  # the door puts them there; removed again after the test
    port = _closed_port()
    for scheme in ("https", "http"):
        uri = f"{scheme}://llama:{SECRET}@127.0.0.1:{port}"
        started = time.perf_counter()
        with pytest.raises(store.TrackingStoreUnavailable) as excinfo:
            store.check_tracking_store(uri)
        assert time.perf_counter() - started < 5, "no retries: a closed port fails in seconds"
        message = str(excinfo.value)
        assert SECRET not in message and f"{scheme}://127.0.0.1:{port}" in message


@pytest.mark.parametrize(
    ("uri", "needle"),
    [("sqlite:///relative/mlflow.db", "absolute SQLite path"), ("file:./mlruns", "file store")],
)
def test_unusable_store_uris_are_rejected(uri: str, needle: str) -> None:
    with pytest.raises(store.TrackingStoreUnavailable, match=needle):
        store.check_tracking_store(uri)


def test_continued_runs_are_found_by_flow_run_tag_or_run_directory(store_uri: str, tmp_path: Path) -> None:
    from tasks.tracking import runs

    first = runs.open_run(
        "tracking-tests", "attempt", run_dir=tmp_path / "a", tags={"prefect.flow_run_id": "fr-1"}
    )
    assert first.continued is None
    # A retry of the same flow run finds its run again (nothing in the run directory yet).
    retry = runs.open_run(
        "tracking-tests", "attempt", run_dir=tmp_path / "b", tags={"prefect.flow_run_id": "fr-1"}
    )
    assert (retry.run_id, retry.continued) == (first.run_id, "flow run fr-1")
    # A rerun with another flow run that resumes a checkpoint directory continues the run recorded there.
    runs.write_run_record(tmp_path / "c", first.run_id)
    store.end_run(first.run_id, "KILLED")
    rerun = runs.open_run(
        "tracking-tests", "other", run_dir=tmp_path / "c", tags={"prefect.flow_run_id": "fr-2"}
    )
    assert rerun.run_id == first.run_id and rerun.continued.startswith("run directory")
    assert store.run_status(first.run_id) == "RUNNING"
    assert store.get_client().get_run(first.run_id).data.tags["prefect.flow_run_id"] == "fr-2"
    # A record of a run this store does not hold starts a new run (with a warning).
    runs.write_run_record(tmp_path / "d", "0" * 32)
    with pytest.warns(RuntimeWarning, match="not in this tracking store"):
        fresh = runs.open_run("tracking-tests", "x", run_dir=tmp_path / "d")
    assert fresh.run_id != first.run_id and fresh.continued is None


def _tracking_uri_unchanged(before: str) -> None:
    assert mlflow.get_tracking_uri() == before
    assert os.environ.get("MLFLOW_TRACKING_URI") == before


def test_system_metrics_and_sink_leave_the_process_wide_tracking_uri_alone(
    store_uri: str, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The caller's process-wide URI points elsewhere (here: a stopped server); ours is given explicitly.
    elsewhere = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    mlflow.set_tracking_uri(elsewhere)
    monitor = start_system_metrics(run_id, sampling_interval_s=0.1, uri=store_uri)
    _tracking_uri_unchanged(elsewhere)
    time.sleep(0.5)
    monitor.finish()
    sink = MlflowSink(run_id, uri=store_uri)
    sink.log_metrics({"train/loss": 1.0}, 1)
    sink.close()
    _tracking_uri_unchanged(elsewhere)
    metrics = store.get_client(store_uri).get_run(run_id).data.metrics
    assert any(key.startswith("system/") for key in metrics) and "train/loss" in metrics


def test_system_metrics_resume_after_the_last_logged_step(store_uri: str, run_id: str) -> None:
    client = store.get_client()
    for _ in range(2):  # a run continued after a kill starts its sampler again
        monitor = start_system_metrics(run_id, sampling_interval_s=0.1)
        time.sleep(0.45)
        monitor.finish()
    steps = [m.step for m in client.get_metric_history(run_id, "system/cpu_utilization_percentage")]
    assert len(steps) >= 4 and len(set(steps)) == len(steps), f"a step logged twice: {sorted(steps)}"


def test_a_train_deployment_gets_the_store_without_its_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefect stores and shows flow-run parameters: the worker's own environment supplies the password."""
    from flows.pool.placement import deployment_parameters
    from flows.pool.remote_train import SharedStorageError, resolve_tracking_uri
    from tasks.refs import ModelRef
    from tasks.training import TrainSettings

    secret_uri = f"postgresql://llama:{SECRET}@db.internal/mlflow"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", secret_uri)
    model = ModelRef(path=str(tmp_path), fingerprint="m", n_params=1)
    parameters = deployment_parameters(
        model, _dataset(tmp_path), TrainSettings(), str(tmp_path), run_id="r", retries=1
    )
    assert SECRET not in json.dumps({k: str(v) for k, v in parameters.items()})
    assert parameters["tracking_uri"] == "postgresql://llama:***@db.internal/mlflow"
    # On the worker: its environment holds the same store with the password.
    assert resolve_tracking_uri(parameters["tracking_uri"]) == secret_uri
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql://llama:other@elsewhere/mlflow")
    with pytest.raises(SharedStorageError, match="MLFLOW_TRACKING_URI") as excinfo:
        resolve_tracking_uri(parameters["tracking_uri"])
    assert SECRET not in str(excinfo.value)


def test_checkpoint_models_logged_again_after_a_crash_log_each_metric_once(
    run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process dies after a checkpoint's validation metrics are logged, before its logged model is
    finalised (every finalize call of that attempt fails); the flow-run retry logs the checkpoints again."""
    from mlflow.entities import LoggedModelStatus
    from mlflow.tracking import MlflowClient

    from tasks.refs import CheckpointScore, EvalResult
    from tasks.tracking import checkpoints

    dataset = _dataset(tmp_path)
    scores = []
    for step, bpb in ((10, 2.5), (20, 2.0)):
        directory = tmp_path / f"step_{step:06d}"
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"weights")
        (directory / "config.json").write_text("{}")
        scores.append(CheckpointScore(step=step, path=str(directory), val_loss=2 * bpb, bits_per_byte=bpb))
    evaluation = EvalResult(
        val_loss=4.0,
        perplexity=54.6,
        bits_per_byte=2.0,
        xz_bits_per_byte=2.2,
        scored_tokens=100,
        scored_bytes=350,
        text_fingerprint="t" * 64,
        dataset_fingerprint=dataset.fingerprint,
        max_blocks=None,
        dtype="fp32",
        checkpoints=tuple(scores),
    )

    def dead(self, model_id, status):
        raise RuntimeError("the process died here")

    with monkeypatch.context() as patch:
        patch.setattr(MlflowClient, "finalize_logged_model", dead)
        with pytest.raises(RuntimeError, match="died here"):
            checkpoints.log_checkpoint_models(run_id, evaluation, dataset)
    ids = checkpoints.log_checkpoint_models(run_id, evaluation, dataset)
    assert checkpoints.log_checkpoint_models(run_id, evaluation, dataset) == ids

    client = store.get_client()
    for key in ("val/bits_per_byte", "val/loss"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [10, 20], key
    experiment_id = client.get_run(run_id).info.experiment_id
    found = client.search_logged_models([experiment_id], filter_string=f"source_run_id = '{run_id}'")
    ready = {m.name: m for m in found if m.status == LoggedModelStatus.READY}
    assert set(ready) == {"checkpoint-000010", "checkpoint-000020"}
    assert {int(m.params["step"]): m.model_id for m in ready.values()} == ids
    for model in ready.values():
        linked = client.get_logged_model(model.model_id).metrics
        assert sorted(m.key for m in linked) == ["val/bits_per_byte", "val/loss"]
