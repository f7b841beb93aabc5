"""The whole flow on the `tiny` preset: real Prefect API, real MLflow SQLite store, real torch.compile; and
the run lifecycle across a flow-run retry and across kill -9 and a rerun."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from prefect.settings import PREFECT_API_URL
from prefect.testing.utilities import prefect_test_harness
from safetensors.torch import load_file

from flows.pretrain import pretrain
from flows.pretrain_config import PretrainConfig
from flows.result import PretrainResult, print_summary
from model import LlamaConfig, LlamaForPretraining, load_pretrained, load_weights
from tasks import home
from tasks.evaluate import evaluate
from tasks.lookup import download_model_files

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prefect_api():
    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="module")
def tiny_run(prefect_api, tmp_path_factory) -> PretrainResult:
    ckpt = tmp_path_factory.mktemp("tiny-run")
    return pretrain(PretrainConfig(preset="tiny", checkpoint_dir=str(ckpt), model_name="e2e-tiny"))


def _flow_run_id(run_id: str) -> str:
    return MlflowClient(home.tracking_uri()).get_run(run_id).data.tags["prefect.flow_run_id"]


def test_flow_registers_a_champion_and_learns(tiny_run: PretrainResult) -> None:
    client = MlflowClient(home.tracking_uri())
    version = client.get_model_version_by_alias("e2e-tiny", "champion")
    assert str(version.version) == tiny_run.registered.version
    assert tiny_run.model_uri.startswith("models:/e2e-tiny")
    assert tiny_run.registered.promoted
    ev = tiny_run.evaluation
    assert ev.initial_val_loss is not None and ev.val_loss < ev.initial_val_loss - 1.0  # 7.6 → ~6.1 measured
    assert ev.initial_bits_per_byte is not None and ev.bits_per_byte < ev.initial_bits_per_byte
    run = client.get_run(tiny_run.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["seq_len"] == "128"
    assert run.data.metrics["val/bits_per_byte"] == ev.bits_per_byte
    assert run.data.metrics["val/xz_bits_per_byte"] == ev.xz_bits_per_byte
    history = client.get_metric_history(tiny_run.run_id, "train/loss")
    assert len(history) == tiny_run.checkpoint.step == 30


def test_the_printed_summary_leads_with_bits_per_byte_and_says_what_set_the_run_length(
    tiny_run: PretrainResult, capsys: pytest.CaptureFixture[str]
) -> None:
    print_summary(tiny_run)
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith(f"validation: {tiny_run.evaluation.bits_per_byte:.3f} bits per byte (xz -9e: ")
    assert "run length: 30 optimizer steps, set by max_steps=30 (epochs=1 not used; " in "\n".join(lines)


def test_the_flow_run_and_the_mlflow_run_point_at_each_other(tiny_run: PretrainResult) -> None:
    tags = MlflowClient(home.tracking_uri()).get_run(tiny_run.run_id).data.tags
    flow_run_id = tags["prefect.flow_run_id"]
    assert tags["prefect.flow_run_url"].endswith(f"/flow-runs/flow-run/{flow_run_id}")
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    links = [a for a in artifacts if a.key == "mlflow-run"]  # a link artifact: markdown `[text](url)`
    assert len(links) == 1 and f"/runs/{tiny_run.run_id})" in links[0].data
    summary = next(a for a in artifacts if a.key == "pretrain-summary")
    assert "bits per byte" in summary.data


def test_the_runs_checkpoints_are_logged_models_and_the_best_is_found_by_bits_per_byte(
    tiny_run: PretrainResult,
) -> None:
    client = MlflowClient(home.tracking_uri())
    scores = {s.step: s for s in tiny_run.evaluation.checkpoints}
    assert set(scores) == {20, 30}  # the tiny preset checkpoints every 10 steps and keeps 2
    assert scores[30].bits_per_byte == tiny_run.evaluation.bits_per_byte
    mlflow.set_tracking_uri(home.tracking_uri())  # as a user would (conftest resets it)
    found = mlflow.search_logged_models(
        experiment_ids=[client.get_run(tiny_run.run_id).info.experiment_id],
        filter_string=f"source_run_id = '{tiny_run.run_id}' AND model_type = 'llamaflow-checkpoint'",
        order_by=[{"field_name": "metrics.val/bits_per_byte", "ascending": True}],
        output_format="list",
    )
    assert sorted(int(m.params["step"]) for m in found) == [20, 30]
    best = found[0]
    assert int(best.params["step"]) == min(scores, key=lambda step: scores[step].bits_per_byte)
    linked = {m.key: m for m in best.metrics}
    assert linked["val/bits_per_byte"].value == scores[int(best.params["step"])].bits_per_byte
    assert linked["val/bits_per_byte"].step == int(best.params["step"])
    assert linked["val/bits_per_byte"].dataset_digest == tiny_run.dataset.fingerprint[:36]
    files = {a.path for a in client.list_logged_model_artifacts(best.model_id)}
    assert files == {"model.safetensors", "config.json"}
    # The run's validation curve: one point per checkpoint, each once.
    history = client.get_metric_history(tiny_run.run_id, "val/bits_per_byte")
    assert sorted(m.step for m in history) == [20, 30]


def test_promotion_emits_a_prefect_event_with_both_numbers(tiny_run: PretrainResult) -> None:
    registered = tiny_run.registered
    body = {
        "filter": {
            "event": {"prefix": ["llamaflow.model."]},
            "any_resource": {"id": [f"mlflow.model-version.e2e-tiny.{registered.version}"]},
        }
    }
    deadline = time.monotonic() + 30
    while True:  # the server persists events asynchronously
        events = httpx.post(f"{PREFECT_API_URL.value()}/events/filter", json=body).json()["events"]
        if events or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [e["event"] for e in events] == ["llamaflow.model.promoted"]
    payload = events[0]["payload"]
    assert payload["model_name"] == "e2e-tiny" and payload["version"] == registered.version
    assert payload["bits_per_byte"] == registered.bits_per_byte
    assert payload["champion_bits_per_byte"] is None
    related = {r["prefect.resource.id"] for r in events[0]["related"]}
    assert f"mlflow.run.{tiny_run.run_id}" in related
    assert f"prefect.flow-run.{_flow_run_id(tiny_run.run_id)}" in related, "automations can match the run"


def test_registered_weights_are_the_plain_module_and_reproduce_the_trained_logits(
    tiny_run: PretrainResult, tmp_path: Path
) -> None:
    local = download_model_files(tiny_run.model_uri, tmp_path).weights.parent.parent
    weights = list(local.rglob("*.safetensors"))
    assert len(weights) == 1
    state = load_file(weights[0])
    assert state and not any(k.startswith("_orig_mod.") for k in state)

    config_file = next(local.rglob("config.json"))
    fresh = LlamaForPretraining(LlamaConfig.from_dict(json.loads(config_file.read_text())))
    load_weights(fresh, weights[0])
    trained = load_pretrained(tiny_run.checkpoint.path)
    batch = torch.randint(
        0, tiny_run.tokenizer.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(batch), trained.eval()(batch), atol=0, rtol=0)
    again = evaluate(tiny_run.checkpoint, tiny_run.dataset, tiny_run.tokenizer, max_blocks=64, num_samples=0)
    assert again.bits_per_byte == tiny_run.evaluation.bits_per_byte


def test_a_registration_retried_after_a_crash_completes_its_run_tag_and_event(
    tiny_run: PretrainResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registering process dies after the decision is recorded, before the run tag and the event (a
    failing call stands for it); the retry sends the event, once."""
    from tasks.register import RUN_TAG_VERSION, register_model
    from tasks.tracking import store

    name = "e2e-retried-registration"
    kwargs = dict(
        run_id=store.start_run("e2e-retried-registration", "retry"),
        checkpoint=tiny_run.checkpoint,
        tokenizer=tiny_run.tokenizer,
        dataset=tiny_run.dataset,
        eval_result=tiny_run.evaluation,
        model_name=name,
        eval_device="cpu",
    )
    real_set_tag = MlflowClient.set_tag

    def dies_once(self, run_id, key, value, *args, **kwargs):
        if key == RUN_TAG_VERSION and not getattr(dies_once, "died", False):
            dies_once.died = True
            raise RuntimeError("the registering process died here")
        return real_set_tag(self, run_id, key, value, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "set_tag", dies_once)
    with pytest.raises(RuntimeError, match="died here"):
        register_model(**kwargs)
    registered = register_model(**kwargs)
    tags = MlflowClient(home.tracking_uri()).get_run(registered.run_id).data.tags
    assert tags[RUN_TAG_VERSION] == f"{name}/{registered.version}"
    body = {"filter": {"any_resource": {"id": [f"mlflow.model-version.{name}.{registered.version}"]}}}
    deadline = time.monotonic() + 30
    while True:  # the server persists events asynchronously
        events = httpx.post(f"{PREFECT_API_URL.value()}/events/filter", json=body).json()["events"]
        if events or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    time.sleep(1.0)  # a second event would have come with the first
    events = httpx.post(f"{PREFECT_API_URL.value()}/events/filter", json=body).json()["events"]
    assert [e["event"] for e in events] == ["llamaflow.model.promoted"]


def test_a_flow_run_ends_the_mlflow_runs_left_running_by_flow_runs_that_are_over(
    prefect_api, tmp_path: Path
) -> None:
    """Runs whose flow-run process died with no chance to end them (kill -9, a lost machine): the next
    flow run of the experiment ends them, as their flow run ended; it leaves running ones alone."""
    from prefect import flow
    from prefect.states import Cancelled, Crashed, Running

    from tasks.tracking import store

    @flow(name="earlier-pretrain")
    def earlier() -> None:
        pass

    experiment = "e2e-left-running"
    ids = {}
    with get_client(sync_client=True) as client:
        for label, state in (("crashed", Crashed()), ("cancelled", Cancelled()), ("running", Running())):
            flow_run = client.create_flow_run(earlier, state=state)
            ids[label] = store.start_run(experiment, label, tags={"prefect.flow_run_id": str(flow_run.id)})
    ids["no flow run"] = store.start_run(experiment, "a script's run")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    with pytest.raises(Exception, match="(?i)empty"):  # fails right after its start: enough here
        pretrain(PretrainConfig(preset="tiny", data=str(empty), experiment=experiment))
    statuses = {label: store.run_status(run_id) for label, run_id in ids.items()}
    assert statuses == {
        "crashed": "FAILED",
        "cancelled": "KILLED",
        "running": "RUNNING",
        "no flow run": "RUNNING",
    }


def test_flow_rejects_an_empty_corpus_before_training(prefect_api, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    ckpt = tmp_path / "ckpt"
    with pytest.raises(Exception, match="(?i)empty"):
        pretrain(PretrainConfig(preset="tiny", data=str(empty), checkpoint_dir=str(ckpt)))
    assert not ckpt.exists()


SHORT = {"max_steps": 12, "checkpoint_every": 5, "compile": False, "eval_max_blocks": 8, "num_samples": 0}


def test_a_flow_run_retry_continues_its_mlflow_run(prefect_api, tmp_path: Path, monkeypatch) -> None:
    """The train task fails (no task retry), the flow run is retried: still one MLflow run, with every step
    once, and one registered version."""
    monkeypatch.setenv("LLAMAFLOW_FAULT_INJECT", "crash_at_step=3")
    config = PretrainConfig(
        preset="tiny", **SHORT, train_retries=0, experiment="e2e-retry", model_name="e2e-retry"
    )
    result = pretrain.with_options(retries=1, retry_delay_seconds=0)(config)
    client = MlflowClient(home.tracking_uri())
    flow_run_id = _flow_run_id(result.run_id)
    with get_client(sync_client=True) as prefect:
        assert prefect.read_flow_run(flow_run_id).run_count == 2, "the flow run was retried"
    experiment = client.get_experiment_by_name("e2e-retry")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == result.run_id and run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == list(
        range(1, 13)
    )
    assert len(client.search_model_versions("name='e2e-retry'")) == 1


def _cli(args: list[str], env: dict[str, str], timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.pretrain", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError):  # a killed flow process leaves nothing behind
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def test_kill_9_and_a_rerun_leave_one_run_with_every_step_once_bit_equal(prefect_api, tmp_path: Path) -> None:
    """The engine writes every step to metrics.jsonl synchronously and resumes bit for bit; MLflow gets
    steps asynchronously, so a kill loses some. The rerun continues the killed MLflow run, fills in what
    it missed and logs nothing twice."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "MLFLOW_TRACKING_URI": home.tracking_uri(),
        "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "0.5",
        "OMP_NUM_THREADS": "1",
    }
    flags = ["--preset", "tiny", "--no-compile", "--eval-max-blocks", "8", "--num-samples", "0"]
    flags += ["--max-steps", "12", "--checkpoint-every", "5"]
    resumed = [
        *flags,
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--experiment",
        "e2e-kill",
        "--model-name",
        "e2e-kill",
    ]
    killed = _cli(resumed, {**env, "LLAMAFLOW_FAULT_INJECT": "kill_at_step=8"})
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    rerun = _cli(resumed, env)
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert "resuming from checkpoint" in rerun.stdout
    reference = [
        *flags,
        "--checkpoint-dir",
        str(tmp_path / "ref"),
        "--experiment",
        "e2e-ref",
        "--model-name",
        "e2e-ref",
    ]
    uninterrupted = _cli(reference, env)
    assert uninterrupted.returncode == 0, uninterrupted.stdout[-3000:]

    client = MlflowClient(home.tracking_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("e2e-kill").experiment_id])
    (ref,) = client.search_runs([client.get_experiment_by_name("e2e-ref").experiment_id])
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, 13)), "every step exactly once"
    expected = {m.step: m.value for m in client.get_metric_history(ref.info.run_id, "train/loss")}
    assert {m.step: m.value for m in history} == expected, "bit-equal to the uninterrupted run"
    system = [m.step for m in client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")]
    assert system and len(set(system)) == len(system), (
        f"system metrics restarted their steps: {sorted(system)}"
    )
    (version,) = client.search_model_versions("name='e2e-kill'")
    assert version.run_id == run.info.run_id


def test_a_budgeted_flow_plans_its_steps_ends_decayed_and_records_the_plan(
    prefect_api, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 52 item 1, cheaply: a budget of one second is too short for the tiny preset's warmup, so the
    plan takes its minimum (warmup + 1 steps) and says so; the schedule ends decayed there."""
    config = PretrainConfig(
        preset="tiny",
        time_budget="1s",
        checkpoint_dir=str(tmp_path / "ckpt"),
        register_version=False,
        experiment="e2e-budget",
        **{k: v for k, v in SHORT.items() if k != "max_steps"},
    )
    assert config.max_steps is None  # the budget, not the preset's max_steps, sets the run length
    result = pretrain(config)
    plan = result.plan
    assert plan is not None and plan.steps == config.warmup_steps + 1 == result.checkpoint.step
    assert "too little for 6 step(s)" in plan.reason
    client = MlflowClient(home.tracking_uri())
    run = client.get_run(result.run_id)
    assert run.data.metrics["budget/planned_steps"] == plan.steps
    assert run.data.params["run_plan"].startswith("6 optimizer steps, set by time_budget=1s: a step takes ")
    lrs = {m.step: m.value for m in client.get_metric_history(result.run_id, "train/lr")}
    assert lrs[plan.steps] == pytest.approx(
        config.lr * config.min_lr_ratio
    )  # decayed at the planned last step
    print_summary(result)
    out = capsys.readouterr().out
    assert "shape: 2 x 64, vocabulary 2048, 8 x 2 x 128 tokens per step (preset tiny)" in out
    assert "OVER its time budget of 1s (the plan expected " in out
