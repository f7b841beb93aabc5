"""tasks.tracking (store, sink, report) against a real, temporary SQLite MLflow store (the server case is in
test_register)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks import home
from tasks.refs import DatasetRef
from tasks.tracking import report, store
from tasks.tracking.sink import MlflowSink, start_system_metrics


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


def test_dataset_input_carries_fingerprint_and_token_counts(run_id: str, tmp_path: Path) -> None:
    ref = DatasetRef(
        path=str(tmp_path / "packed-abc"),
        fingerprint="f" * 64,
        seq_len=128,
        vocab_size=512,
        train_blocks=10,
        val_blocks=2,
        train_tokens=1290,
        val_tokens=258,
        stats={"documents": 7},
    )
    store.log_dataset_input(run_id, ref)
    inputs = store.get_client().get_run(run_id).inputs.dataset_inputs
    assert len(inputs) == 1
    dataset = inputs[0].dataset
    assert dataset.name == "packed-abc"
    assert dataset.digest == ref.fingerprint[:36]
    profile = json.loads(dataset.profile)
    assert profile["fingerprint"] == ref.fingerprint
    assert profile["train_tokens"] == 1290 and profile["val_tokens"] == 258
    assert profile["stats.documents"] == 7
    assert {t.key: t.value for t in inputs[0].tags}["mlflow.data.context"] == "training"


def test_sink_batches_by_step_count_and_keeps_every_point(run_id: str) -> None:
    client = store.get_client()
    sink = MlflowSink(run_id, flush_every_steps=50, flush_every_s=3600)
    started = time.perf_counter()
    for step in range(120):
        sink.log_metrics(
            {"train/loss": 10.0 - step * 0.05, "train/lr": 1e-3, "train/tokens_per_s": 5000.0}, step
        )
    per_step_ms = (time.perf_counter() - started) / 120 * 1000
    assert sink.flushes == 2
    assert len(client.get_metric_history(run_id, "train/loss")) == 100  # the last 20 are still buffered
    sink.close()
    assert sink.flushes == 3
    history = sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(120))
    assert history[7].value == pytest.approx(10.0 - 7 * 0.05)
    print(f"MlflowSink overhead: {per_step_ms:.3f} ms/step (3 metrics, flush every 50 steps, SQLite)")
    assert per_step_ms < 20, "batched logging should cost well under a synchronous call per metric"
    with pytest.raises(RuntimeError, match="closed"):
        sink.log_metrics({"train/loss": 1.0}, 121)


def test_sink_flushes_on_time(run_id: str) -> None:
    client = store.get_client()
    sink = MlflowSink(run_id, flush_every_steps=10_000, flush_every_s=0.2)
    sink.log_metrics({"val/loss": 4.0}, 0)
    assert client.get_metric_history(run_id, "val/loss") == []
    time.sleep(0.3)
    sink.log_metrics({"val/loss": 3.5}, 1)
    assert [m.value for m in client.get_metric_history(run_id, "val/loss")] == [4.0, 3.5]
    sink.close()


def test_sink_keeps_metrics_through_a_failed_flush(run_id: str) -> None:
    client = store.get_client()
    sink = MlflowSink(run_id, flush_every_steps=5, flush_every_s=3600)
    for step in range(5):
        sink.log_metrics({"train/loss": float(step)}, step)
    client.delete_run(run_id)  # the store now refuses writes to this run, like an outage would
    with pytest.warns(RuntimeWarning, match="5 kept for the next flush"):
        for step in range(5, 10):
            sink.log_metrics({"train/loss": float(step)}, step)
    assert (sink.flushes, sink.failed_flushes) == (1, 1)
    client.restore_run(run_id)
    for step in range(10, 15):
        sink.log_metrics({"train/loss": float(step)}, step)
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == list(range(15))

    client.delete_run(run_id)
    sink.log_metrics({"train/loss": 15.0}, 15)
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="1 metrics could not be written"):
        sink.close()


def test_sink_checks_the_run_and_store_up_front(store_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        MlflowSink("0" * 32)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(store.TrackingStoreUnavailable):
        MlflowSink("0" * 32)


def test_training_curves_from_the_engine_metrics_with_a_torn_last_line(run_id: str, tmp_path: Path) -> None:
    from tasks.training.metrics import JsonlMetrics, read_metrics

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


@pytest.mark.parametrize(
    ("uri", "needle"),
    [("sqlite:///relative/mlflow.db", "absolute SQLite path"), ("file:./mlruns", "file store")],
)
def test_unusable_store_uris_are_rejected(uri: str, needle: str) -> None:
    with pytest.raises(store.TrackingStoreUnavailable, match=needle):
        store.check_tracking_store(uri)


def test_system_metrics_reach_the_run_in_the_configured_store(
    store_uri: str, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow

    # A process-wide URI left by earlier code (here: a stopped server) must not capture the sampler.
    mlflow.set_tracking_uri("http://127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    try:
        monitor = start_system_metrics(run_id, sampling_interval_s=0.1)
        time.sleep(0.5)
        monitor.finish()
    finally:
        mlflow.set_tracking_uri(None)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    metrics = store.get_client().get_run(run_id).data.metrics
    assert any(key.startswith("system/") for key in metrics)
