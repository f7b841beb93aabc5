"""Registration, promotion, lookup and the pyfunc, on a real MLflow store (SQLite) and a real server.

The fixture world is small but real: a BPE tokenizer trained on a few KB of stdlib source, packed
blocks per the dataset contract, a `tiny` Llama at random init and the same one after 40 AdamW steps.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from model import LlamaConfig, LlamaForPretraining, get_preset, load_pretrained, save_weights
from tasks import register
from tasks.dataset import build_dataset
from tasks.evaluate import mean_token_loss
from tasks.lookup import load_model, parse_model_uri
from tasks.refs import CheckpointRef, DatasetRef, EvalResult, TokenizerRef
from tasks.tokenize import train_tokenizer
from tasks.tracking import store as tracking_store
from tasks.tracking.report import training_curves_figure
from tasks.tracking.sink import MlflowSink

SEQ_LEN = 64
VOCAB = 384
PAD_ID, BOS_ID, EOS_ID = 2, 0, 1


# --------------------------------------------------------------------------------------------------
# The fixture world: tokenizer, two packed datasets, three checkpoints


def _stdlib_text(names: tuple[str, ...], limit: int) -> list[str]:
    root = Path(os.__file__).parent
    return [(root / name).read_text(encoding="utf-8")[:limit] for name in names]


def _corpus(root: Path, name: str, texts: list[str]) -> str:
    directory = root / name
    directory.mkdir(parents=True)
    for i, text in enumerate(texts):
        (directory / f"doc{i}.py").write_text(text)
    return str(directory)


def _checkpoint(directory: Path, model: LlamaForPretraining) -> CheckpointRef:
    directory.mkdir(parents=True)
    save_weights(model, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(model.config.to_dict()))
    return CheckpointRef(path=str(directory), run_dir=str(directory.parent), step=0, tokens_seen=0)


def _config() -> LlamaConfig:
    return get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=128)


def _train(model: LlamaForPretraining, dataset: DatasetRef, steps: int) -> None:
    blocks = torch.from_numpy(np.load(Path(dataset.path) / "train.npy").astype(np.int64))
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = blocks[torch.randint(len(blocks), (8,), generator=generator)]
        targets = batch[:, 1:].masked_fill(batch[:, 1:] == PAD_ID, -100)
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), targets.flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def _val_loss(checkpoint: CheckpointRef, dataset: DatasetRef, max_blocks: int | None = None) -> float:
    model = load_pretrained(checkpoint.path).eval()
    return mean_token_loss(model, Path(dataset.path) / "val.npy", pad_id=PAD_ID, max_blocks=max_blocks)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # The tiny model runs ~20x slower on 2 threads than on 1 when other processes share the 2 cores.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass(frozen=True)
class World:
    tokenizer: TokenizerRef
    dataset: DatasetRef
    other_dataset: DatasetRef
    random_init: CheckpointRef
    other_init: CheckpointRef
    trained: CheckpointRef


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("register-world")
    texts = _stdlib_text(("textwrap.py", "shlex.py", "fnmatch.py", "colorsys.py", "bisect.py"), 6000)
    a_train, a_val = _corpus(root, "a-train", texts[:4]), _corpus(root, "a-val", texts[4:])
    tokenizer = train_tokenizer(a_train, VOCAB, val_data=a_val)
    dataset = build_dataset(a_train, tokenizer, SEQ_LEN, val_data=a_val, keep_remainder=True)
    b_train, b_val = _corpus(root, "b-train", texts[1:]), _corpus(root, "b-val", texts[:1])
    other = build_dataset(b_train, tokenizer, SEQ_LEN, val_data=b_val, keep_remainder=True)
    torch.manual_seed(0)
    model = LlamaForPretraining(_config())
    random_init = _checkpoint(root / "random-init", model)
    torch.manual_seed(1)
    other_init = _checkpoint(root / "other-init", LlamaForPretraining(_config()))
    _train(model, dataset, steps=40)
    trained = _checkpoint(root / "trained", model)
    return World(tokenizer, dataset, other, random_init, other_init, trained)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One SQLite store for the module; tests use distinct model names within it."""
    root = tmp_path_factory.mktemp("sqlite-store")
    uri = f"sqlite:///{root / 'mlruns' / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLAMAFLOW_MLRUNS", str(root / "mlruns"))
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        yield uri


def _register(
    world: World, checkpoint: CheckpointRef, dataset: DatasetRef, name: str, max_blocks: int = 256
) -> register.RegisteredModel:
    run_id = tracking_store.start_run("register-tests", run_name=Path(checkpoint.path).name)
    loss = _val_loss(checkpoint, dataset, max_blocks)
    result = register.register_model(
        run_id=run_id,
        checkpoint=checkpoint,
        tokenizer=world.tokenizer,
        dataset=dataset,
        eval_result=EvalResult(val_loss=loss, perplexity=float(np.exp(loss))),
        model_name=name,
        eval_max_blocks=max_blocks,
        eval_device="cpu",
    )
    tracking_store.end_run(run_id)
    return result


def _logits(model: LlamaForPretraining) -> torch.Tensor:
    ids = torch.arange(3, 3 + 2 * SEQ_LEN).reshape(2, SEQ_LEN) % VOCAB
    with torch.no_grad():
        return model(ids)


# --------------------------------------------------------------------------------------------------
# SQLite store


@pytest.fixture(scope="module")
def registered(world: World, store: str) -> dict[str, register.RegisteredModel]:
    """random init (champion) → trained (better, takes it) → other init (worse, does not)."""
    first = _register(world, world.random_init, world.dataset, "llamaflow-test")
    better = _register(world, world.trained, world.dataset, "llamaflow-test")
    worse = _register(world, world.other_init, world.dataset, "llamaflow-test")
    return {"first": first, "better": better, "worse": worse}


def test_only_better_models_take_the_alias(
    world: World, registered: dict[str, register.RegisteredModel]
) -> None:
    client = tracking_store.get_client()
    first, better, worse = registered["first"], registered["better"], registered["worse"]
    assert (first.version, better.version, worse.version) == ("1", "2", "3")
    assert first.promoted and first.champion_val_loss is None
    assert better.promoted and worse.promoted is False
    assert str(client.get_model_version_by_alias("llamaflow-test", "champion").version) == "2"

    loss_init = _val_loss(world.random_init, world.dataset)
    loss_trained = _val_loss(world.trained, world.dataset)
    loss_other = _val_loss(world.other_init, world.dataset)
    assert loss_trained < loss_init - 0.3, "40 training steps should clearly beat random init"

    tags = {v: client.get_model_version("llamaflow-test", v).tags for v in ("1", "2", "3")}
    assert tags["1"][register.TAG_PROMOTED] == "true"
    assert tags["1"][register.TAG_CHAMPION_VAL_LOSS] == "none"
    assert tags["2"][register.TAG_PROMOTED] == "true"
    assert float(tags["2"][register.TAG_VAL_LOSS]) == pytest.approx(loss_trained)
    assert float(tags["2"][register.TAG_CHAMPION_VAL_LOSS]) == pytest.approx(loss_init)
    assert tags["2"][register.TAG_CHAMPION_VERSION] == "1"
    assert tags["3"][register.TAG_PROMOTED] == "false"
    assert float(tags["3"][register.TAG_VAL_LOSS]) == pytest.approx(loss_other)
    assert float(tags["3"][register.TAG_CHAMPION_VAL_LOSS]) == pytest.approx(loss_trained)
    assert tags["3"][register.TAG_COMPARISON] == "recorded on the same dataset with the same eval method"
    assert all(t[register.TAG_DATASET] == world.dataset.fingerprint for t in tags.values())

    description = client.get_model_version("llamaflow-test", "3").description
    assert "did not take 'champion' from version 2" in description
    assert f"{loss_other:.4f}" in description and f"{loss_trained:.4f}" in description
    assert client.get_run(better.run_id).data.tags["llamaflow.registered_version"] == "llamaflow-test/2"
    # Aliases only: no version is ever moved to a stage.
    assert {client.get_model_version("llamaflow-test", v).current_stage for v in ("1", "2", "3")} == {"None"}


def test_champion_is_reevaluated_on_other_validation_data(world: World, store: str) -> None:
    champion = _register(world, world.trained, world.dataset, "llamaflow-reeval")
    # The trained model's loss on data-b's val (seen in its training data) vs random init on it.
    challenger = _register(world, world.random_init, world.other_dataset, "llamaflow-reeval")
    assert champion.promoted and not challenger.promoted
    tags = tracking_store.get_client().get_model_version("llamaflow-reeval", challenger.version).tags
    expected = _val_loss(world.trained, world.other_dataset)
    assert float(tags[register.TAG_CHAMPION_VAL_LOSS]) == pytest.approx(expected, rel=1e-6)
    assert challenger.champion_val_loss == pytest.approx(expected, rel=1e-6)
    assert tags[register.TAG_COMPARISON].startswith("champion re-evaluated on dataset")
    assert tags[register.TAG_DATASET] == world.other_dataset.fingerprint

    # Same dataset as the champion's but fewer eval blocks: its recorded number is not comparable.
    fewer = _register(world, world.random_init, world.dataset, "llamaflow-reeval", max_blocks=4)
    tags = tracking_store.get_client().get_model_version("llamaflow-reeval", fewer.version).tags
    assert fewer.champion_val_loss == pytest.approx(_val_loss(world.trained, world.dataset, 4), rel=1e-6)
    assert tags[register.TAG_COMPARISON].startswith("champion re-evaluated on dataset")
    assert tags[register.TAG_EVAL_METHOD] == register.eval_method(4, "bf16")


def test_lookup_returns_the_saved_weights_uncompiled(
    world: World, registered: dict[str, register.RegisteredModel]
) -> None:
    model, tokenizer = load_model("models:/llamaflow-test@champion")
    assert not hasattr(model, "_orig_mod") and not model.training
    expected = load_pretrained(world.trained.path).eval()
    assert torch.equal(_logits(model), _logits(expected))
    assert (
        tokenizer.encode("def f(x):").ids == Tokenizer.from_file(world.tokenizer.path).encode("def f(x):").ids
    )

    first, _ = load_model("models:/llamaflow-test/1")
    assert torch.equal(_logits(first), _logits(load_pretrained(world.random_init.path).eval()))

    with pytest.raises(ValueError, match="models:/NAME@ALIAS"):
        load_model("runs:/abc/model")
    with pytest.raises(LookupError, match="known aliases: \\['champion'\\]"):
        load_model("models:/llamaflow-test@staging")
    with pytest.raises(LookupError, match="no registered model named 'nope'"):
        load_model("models:/nope@champion")
    assert parse_model_uri("models:/a-b/12") == ("a-b", None, "12")


def test_registered_artifacts_hold_no_pickles(
    registered: dict[str, register.RegisteredModel], store: str, tmp_path: Path
) -> None:
    import mlflow

    tracking_store.use_tracking_uri()
    local = Path(mlflow.artifacts.download_artifacts("models:/llamaflow-test/2", dst_path=str(tmp_path)))
    files = [p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()]
    assert not [
        f for f in files if f.endswith((".pt", ".pth", ".pkl", ".pickle", ".bin", ".joblib", ".ckpt"))
    ]
    assert [f for f in files if f.endswith(".safetensors")] == ["artifacts/model.safetensors"]
    assert "python_model.pkl" not in [Path(f).name for f in files]
    assert "code/model/llama.py" in files
    mlmodel = (local / "MLmodel").read_text()
    assert "loader_module: mlflow.pyfunc.loaders.code_model" in mlmodel  # the python_model is code
    assert "pyfunc.py" in files
    requirements = (local / "requirements.txt").read_text()
    assert "+cpu" not in requirements and "torch>=" in requirements


def test_pyfunc_predicts_in_a_new_process_without_the_repo(
    registered: dict[str, register.RegisteredModel], store: str, tmp_path: Path
) -> None:
    repo = str(Path(register.__file__).resolve().parents[1])
    script = f"""
import importlib.util, json, sys
sys.path[:] = [p for p in sys.path if p not in ("", {repo!r})]
assert importlib.util.find_spec("model") is None, "the repo must not be importable here"
import mlflow
model = mlflow.pyfunc.load_model("models:/llamaflow-test@champion")
out = model.predict(["def ", ""], params={{"max_new_tokens": 6, "temperature": 0.0}})
again = model.predict(["def ", ""], params={{"max_new_tokens": 6, "temperature": 0.0}})
assert out == again, "greedy decoding must be deterministic"
print("RESULT" + json.dumps(out))
"""
    env = {**os.environ, "MLFLOW_TRACKING_URI": store, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    print(f"new process load + 2 predicts: {time.perf_counter() - started:.1f} s -> {out}")
    assert len(out) == 2 and all(isinstance(text, str) and text for text in out)


def test_pyfunc_in_process_takes_dataframes_and_checks_params(
    registered: dict[str, register.RegisteredModel], store: str
) -> None:
    import mlflow
    import pandas as pd

    tracking_store.use_tracking_uri()
    model = mlflow.pyfunc.load_model("models:/llamaflow-test@champion")
    greedy = {"max_new_tokens": 4, "temperature": 0.0}
    from_list = model.predict(["def ", "class "], params=greedy)
    assert model.predict(pd.DataFrame({"prompt": ["def ", "class "]}), params=greedy) == from_list
    sampling = {"max_new_tokens": 6, "temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": 3}
    assert model.predict(["def "], params=sampling) == model.predict(["def "], params=sampling)
    assert len(model.predict(["def "], params={"top_k": 100_000, "max_new_tokens": 2})) == 1
    with pytest.raises(Exception, match="top_p must be in"):
        model.predict(["def "], params={"top_p": 0.0})
    with pytest.raises(Exception, match="leaves no room for the prompt"):
        model.predict(["def "], params={"max_new_tokens": 500})


def test_a_champion_that_is_not_a_llamaflow_model_is_not_replaced(
    world: World, store: str, tmp_path: Path
) -> None:
    import mlflow

    code = tmp_path / "echo_model.py"
    code.write_text(
        "import mlflow\n"
        "class Echo(mlflow.pyfunc.PythonModel):\n"
        "    def predict(self, context, model_input, params=None):\n"
        "        return list(model_input)\n"
        "mlflow.models.set_model(Echo())\n"
    )
    tracking_store.use_tracking_uri()
    run_id = tracking_store.start_run("register-tests", run_name="foreign")
    logged = tracking_store.get_client().create_logged_model(
        experiment_id=tracking_store.ensure_experiment("register-tests"), source_run_id=run_id
    )
    mlflow.pyfunc.log_model(
        name="echo",
        python_model=str(code),
        pip_requirements=["mlflow"],
        model_id=logged.model_id,
        registered_model_name="llamaflow-foreign",
    )
    tracking_store.get_client().set_registered_model_alias("llamaflow-foreign", "champion", "1")
    ours = _register(world, world.trained, world.dataset, "llamaflow-foreign")
    assert not ours.promoted and ours.champion_val_loss is None
    tags = tracking_store.get_client().get_model_version("llamaflow-foreign", ours.version).tags
    assert tags[register.TAG_COMPARISON].startswith("champion cannot be loaded as a llamaflow model")
    assert tags[register.TAG_CHAMPION_VAL_LOSS] == "none"


def test_bad_inputs_fail_before_anything_is_logged(world: World, store: str, tmp_path: Path) -> None:
    run_id = tracking_store.start_run("register-tests")
    kwargs = dict(run_id=run_id, tokenizer=world.tokenizer, dataset=world.dataset, model_name="never")
    empty = CheckpointRef(path=str(tmp_path), run_dir=str(tmp_path), step=0, tokens_seen=0)
    with pytest.raises(FileNotFoundError, match="lacks model.safetensors"):
        register.register_model(
            checkpoint=empty, eval_result=EvalResult(val_loss=1.0, perplexity=2.7), **kwargs
        )
    with pytest.raises(ValueError, match="diverged"):
        register.register_model(
            checkpoint=world.trained, eval_result=EvalResult(val_loss=float("nan"), perplexity=1.0), **kwargs
        )
    assert "never" not in [m.name for m in tracking_store.get_client().search_registered_models()]


# --------------------------------------------------------------------------------------------------
# A real `mlflow server` (SQLite backend, proxied artifacts)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("mlflow-server")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mlflow_cli = str(Path(sys.executable).with_name("mlflow"))
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(
        [
            mlflow_cli,
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
        ],
        cwd=root,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server did not come up: {(root / 'server.log').read_text()[-2000:]}"
                )
            time.sleep(0.25)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_tracking_and_registry_through_a_server(
    world: World, server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    assert tracking_store.check_tracking_store() == server
    run_id = tracking_store.start_run("server-tests", run_name="over-http")
    tracking_store.log_params(run_id, {"model": _config().to_dict()})
    tracking_store.log_dataset_input(run_id, world.dataset)
    sink = MlflowSink(run_id, flush_every_steps=10)
    history = {step: {"train/loss": 6.0 - 0.1 * step, "train/lr": 1e-3} for step in range(25)}
    for step, metrics in history.items():
        sink.log_metrics(metrics, step)
    sink.close()
    tracking_store.get_client().log_figure(run_id, training_curves_figure(history), "loss_curve.png")
    result = register.register_model(
        run_id=run_id,
        checkpoint=world.trained,
        tokenizer=world.tokenizer,
        dataset=world.dataset,
        eval_result=EvalResult(val_loss=_val_loss(world.trained, world.dataset), perplexity=1.0),
        model_name="llamaflow-server",
    )
    tracking_store.end_run(run_id)

    client = tracking_store.get_client()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["model.hidden_size"] == "64"
    assert len(client.get_metric_history(run_id, "train/loss")) == 25
    assert run.inputs.dataset_inputs[0].dataset.digest == world.dataset.fingerprint[:36]
    assert "loss_curve.png" in [f.path for f in client.list_artifacts(run_id)]
    assert tracking_store.run_link(run_id).startswith(f"{server}/#/experiments/")

    assert result.promoted and result.version == "1"
    model, _ = load_model("models:/llamaflow-server@champion")
    assert torch.equal(_logits(model), _logits(load_pretrained(world.trained.path).eval()))
