"""Registration, promotion, lookup and the pyfunc on a real MLflow store (SQLite); the server case is in
test_register_server.py. The fixture world is in registry_world.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from tokenizers import Tokenizer

from model import LlamaForPretraining, load_pretrained
from registry_world import (
    EOS_ID,
    PAD_ID,
    SEQ_LEN,
    VOCAB,
    World,
    build_world,
    mlmodel_absolute_paths,
    new_run,
    one_thread,
    score,
)
from registry_world import sqlite_store as sqlite_store_at
from tasks import register
from tasks.lookup import load_model, parse_model_uri
from tasks.refs import CheckpointRef, DatasetRef, EvalResult, RegisteredModel
from tasks.tracking import store as tracking_store

REPO = Path(register.__file__).resolve().parents[1]
FORGED = "99.0"  # a champion's bits_per_byte tag rewritten by the worker that registered it


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with one_thread():
        yield build_world(tmp_path_factory.mktemp("register-world"))


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One SQLite store for the module; tests use distinct model names within it."""
    with sqlite_store_at(tmp_path_factory.mktemp("sqlite-store")) as uri:
        yield uri


def _register(
    world: World,
    checkpoint: CheckpointRef,
    dataset: DatasetRef,
    name: str,
    max_blocks: int = 256,
    tokenizer=None,
    **kwargs,
) -> RegisteredModel:
    tokenizer = tokenizer or world.tokenizer
    run_id = new_run(Path(checkpoint.path).name)
    result = register.register_model(
        run_id=run_id,
        checkpoint=checkpoint,
        tokenizer=tokenizer,
        dataset=dataset,
        eval_result=score(checkpoint, dataset, tokenizer, max_blocks),
        model_name=name,
        eval_device="cpu",
        **kwargs,
    )
    tracking_store.end_run(run_id)
    return result


def _logits(model: LlamaForPretraining) -> torch.Tensor:
    ids = torch.arange(3, 3 + 2 * SEQ_LEN).reshape(2, SEQ_LEN) % VOCAB
    with torch.no_grad():
        return model(ids)


@pytest.fixture(scope="module")
def registered(world: World, sqlite_store: str) -> dict[str, RegisteredModel]:
    """random init (champion) → trained (better, takes it) → other init (worse, does not, although the
    champion's `llamaflow.bits_per_byte` was forged to 99 before: a worker may rewrite the tags of the
    versions it registered, so the decision reuses only the score it recorded itself,
    `llamaflow.promoter_score`, which only promoters may write on a flows.services server: test_services.py)."""
    first = _register(world, world.random_init, world.dataset, "llamaflow-test")
    better = _register(world, world.trained, world.dataset, "llamaflow-test")
    client = tracking_store.get_client()
    client.set_model_version_tag("llamaflow-test", better.version, register.TAG_BITS_PER_BYTE, FORGED)
    worse = _register(world, world.other_init, world.dataset, "llamaflow-test")
    return {"first": first, "better": better, "worse": worse}


def test_only_better_models_take_the_alias(world: World, registered: dict[str, RegisteredModel]) -> None:
    client = tracking_store.get_client()
    first, better, worse = registered["first"], registered["better"], registered["worse"]
    assert (first.version, better.version, worse.version) == ("1", "2", "3")
    assert first.promoted and first.champion_bits_per_byte is None
    assert better.promoted and worse.promoted is False
    assert str(client.get_model_version_by_alias("llamaflow-test", "champion").version) == "2"

    bpb_init = score(world.random_init, world.dataset, world.tokenizer).bits_per_byte
    bpb_trained = score(world.trained, world.dataset, world.tokenizer).bits_per_byte
    bpb_other = score(world.other_init, world.dataset, world.tokenizer).bits_per_byte
    assert bpb_trained < bpb_init - 0.3, "40 training steps should clearly beat random init"
    assert better.bits_per_byte == bpb_trained and better.champion_bits_per_byte == bpb_init

    tags = {v: client.get_model_version("llamaflow-test", v).tags for v in ("1", "2", "3")}
    assert tags["1"][register.TAG_PROMOTED] == "true"
    assert tags["1"][register.TAG_CHAMPION_BITS_PER_BYTE] == "none"
    assert tags["2"][register.TAG_PROMOTED] == "true"
    assert float(tags["1"][register.TAG_BITS_PER_BYTE]) == bpb_init
    assert tags["2"][register.TAG_BITS_PER_BYTE] == FORGED
    assert float(tags["2"][register.TAG_CHAMPION_BITS_PER_BYTE]) == bpb_init
    assert tags["2"][register.TAG_CHAMPION_VERSION] == "1"
    assert tags["3"][register.TAG_PROMOTED] == "false"
    assert float(tags["3"][register.TAG_BITS_PER_BYTE]) == bpb_other
    assert float(tags["3"][register.TAG_CHAMPION_BITS_PER_BYTE]) == bpb_trained  # the record's, not FORGED
    assert tags["3"][register.TAG_COMPARISON] == "recorded on the same validation text"
    assert all(t[register.TAG_DATASET] == world.dataset.fingerprint for t in tags.values())

    description = client.get_model_version("llamaflow-test", "3").description
    assert "did not take 'champion' from version 2" in description
    assert f"{bpb_other:.4f}" in description and f"{bpb_trained:.4f}" in description
    assert client.get_run(better.run_id).data.tags["llamaflow.registered_version"] == "llamaflow-test/2"
    # Aliases only: no version is ever moved to a stage.
    assert {client.get_model_version("llamaflow-test", v).current_stage for v in ("1", "2", "3")} == {"None"}


def test_champion_is_rescored_on_other_validation_text(world: World, sqlite_store: str) -> None:
    champion = _register(world, world.trained, world.dataset, "llamaflow-rescore")
    # The trained model on data-b's validation text (seen in its training data) vs random init on it.
    challenger = _register(world, world.random_init, world.other_dataset, "llamaflow-rescore")
    assert champion.promoted and not challenger.promoted
    tags = tracking_store.get_client().get_model_version("llamaflow-rescore", challenger.version).tags
    expected = score(world.trained, world.other_dataset, world.tokenizer).bits_per_byte
    assert float(tags[register.TAG_CHAMPION_BITS_PER_BYTE]) == pytest.approx(expected, rel=1e-6)
    assert challenger.champion_bits_per_byte == pytest.approx(expected, rel=1e-6)
    assert tags[register.TAG_COMPARISON].startswith("champion re-scored on this validation text")
    assert tags[register.TAG_DATASET] == world.other_dataset.fingerprint

    # Same dataset as the champion's but fewer scored blocks: another text, so its number is not reused.
    fewer = _register(world, world.random_init, world.dataset, "llamaflow-rescore", max_blocks=2)
    expected = score(world.trained, world.dataset, world.tokenizer, 2).bits_per_byte
    assert fewer.champion_bits_per_byte == pytest.approx(expected, rel=1e-6)


def test_a_champion_with_another_vocabulary_is_compared_in_bits_per_byte_and_replaced(
    world: World, sqlite_store: str
) -> None:
    name = "llamaflow-vocab"
    other = {"tokenizer": world.other_tokenizer}
    # The champion was scored on the first 2 blocks of its own tokens only: another text than ours.
    champion = _register(
        world, world.other_vocab_init, world.other_vocab_dataset, name, max_blocks=2, **other
    )
    challenger = _register(world, world.trained, world.dataset, name)
    assert champion.promoted and challenger.promoted
    client = tracking_store.get_client()
    assert str(client.get_model_version_by_alias(name, "champion").version) == challenger.version
    tags = client.get_model_version(name, challenger.version).tags
    assert tags[register.TAG_COMPARISON].startswith("champion re-scored on this validation text")
    # Both datasets hold the whole of the same validation file, so our validation text is also the whole of
    # the champion's split: re-scored with its own tokenizer, it gets what evaluate gives it there.
    expected = score(world.other_vocab_init, world.other_vocab_dataset, world.other_tokenizer).bits_per_byte
    assert challenger.champion_bits_per_byte == pytest.approx(expected, rel=1e-6)
    assert challenger.bits_per_byte < challenger.champion_bits_per_byte

    # The same text in other tokens has the same fingerprint: the recorded number is compared directly.
    third = _register(world, world.other_vocab_init, world.other_vocab_dataset, name, **other)
    tags = client.get_model_version(name, third.version).tags
    assert tags[register.TAG_COMPARISON] == "recorded on the same validation text"
    assert third.champion_bits_per_byte == challenger.bits_per_byte and not third.promoted


def test_registering_a_run_again_returns_its_version(world: World, sqlite_store: str) -> None:
    """A flow-run retry after the registration step must not register a second version."""
    run_id = new_run("twice")
    kwargs = dict(
        run_id=run_id,
        checkpoint=world.half_trained,
        tokenizer=world.tokenizer,
        dataset=world.dataset,
        eval_result=score(world.half_trained, world.dataset, world.tokenizer),
        model_name="llamaflow-twice",
        eval_device="cpu",
    )
    first = register.register_model(**kwargs)
    again = register.register_model(**kwargs)
    assert again == first
    assert len(tracking_store.get_client().search_model_versions("name='llamaflow-twice'")) == 1


_RACER = """
import json, sys, time
from pathlib import Path
from tasks.register import register_model
from tasks.refs import CheckpointRef, DatasetRef, EvalResult, TokenizerRef
from mlflow.tracking import MlflowClient
args = json.loads(sys.argv[1])
# A slow store: the alias moves 1 s after the compare, so the two compare-and-sets overlap (the real call
# runs; only the window a slow server would open is made wide enough to hit every time).
_set_alias = MlflowClient.set_registered_model_alias
def _slow_set_alias(self, *a, **k):
    time.sleep(1.0)
    return _set_alias(self, *a, **k)
MlflowClient.set_registered_model_alias = _slow_set_alias
Path(args["ready"]).touch()
while not Path(args["go"]).exists():
    time.sleep(0.01)
time.sleep(args["delay_s"])
result = register_model(
    run_id=args["run_id"],
    checkpoint=CheckpointRef.model_validate(args["checkpoint"]),
    tokenizer=TokenizerRef.model_validate(args["tokenizer"]),
    dataset=DatasetRef.model_validate(args["dataset"]),
    eval_result=EvalResult.model_validate(args["eval_result"]),
    model_name=args["model_name"],
    eval_device="cpu",
)
print("RESULT" + result.model_dump_json())
"""


@pytest.mark.parametrize("better_starts_first", [True, False])
def test_two_registrations_started_together_leave_the_better_one_champion(
    world: World, sqlite_store: str, tmp_path: Path, better_starts_first: bool
) -> None:
    """nightly and adhoc finishing together: both beat the old champion, the better must end up holding it.

    The second starts 0.5 s after the first, well before the first moves the alias (logging the model
    takes seconds), so both compare against the same old champion; each alias move takes 1 s (a slow
    store), so without the per-model lock the later compare-and-set overwrites the earlier one."""
    name = f"llamaflow-race-{int(better_starts_first)}"
    _register(world, world.random_init, world.dataset, name)
    contenders = {"better": world.trained, "worse": world.half_trained}
    delays = {"better": 0.0, "worse": 0.5} if better_starts_first else {"better": 0.5, "worse": 0.0}
    go = tmp_path / "go"
    procs = {}
    for label, checkpoint in contenders.items():
        args = {
            "ready": str(tmp_path / f"ready-{label}"),
            "go": str(go),
            "delay_s": delays[label],
            "run_id": new_run(label),
            "checkpoint": checkpoint.model_dump(),
            "tokenizer": world.tokenizer.model_dump(),
            "dataset": world.dataset.model_dump(),
            "eval_result": score(checkpoint, world.dataset, world.tokenizer).model_dump(),
            "model_name": name,
        }
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        procs[label] = subprocess.Popen(
            [sys.executable, "-c", _RACER, json.dumps(args)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready-{label}").exists() for label in contenders):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values())
        time.sleep(0.05)
    go.touch()
    results = {}
    for label, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
        results[label] = RegisteredModel.model_validate_json(out.split("RESULT", 1)[1])
    champion = tracking_store.get_client().get_model_version_by_alias(name, "champion")
    assert str(champion.version) == results["better"].version
    assert results["better"].promoted
    assert not results["worse"].promoted or better_starts_first is False


def test_no_function_changes_the_process_wide_tracking_uri(
    world: World, sqlite_store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller's process-wide URI points at another store; registering (which loads and re-scores the
    champion) and looking up in ours must leave it alone, and write nothing there."""
    name = "llamaflow-uri"
    _register(world, world.trained, world.other_dataset, name)  # re-scored below: another text
    elsewhere = f"sqlite:///{tmp_path / 'elsewhere' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    mlflow.set_tracking_uri(elsewhere)
    run_id = new_run("explicit-uri", uri=sqlite_store)
    result = register.register_model(
        run_id=run_id,
        checkpoint=world.random_init,
        tokenizer=world.tokenizer,
        dataset=world.dataset,
        eval_result=score(world.random_init, world.dataset, world.tokenizer),
        model_name=name,
        tracking_uri=sqlite_store,
        eval_device="cpu",
    )
    assert result.champion_bits_per_byte is not None, "the champion was re-scored"
    assert mlflow.get_tracking_uri() == elsewhere and os.environ["MLFLOW_TRACKING_URI"] == elsewhere
    load_model(f"models:/{name}/{result.version}", tracking_uri=sqlite_store)
    assert mlflow.get_tracking_uri() == elsewhere and os.environ["MLFLOW_TRACKING_URI"] == elsewhere
    assert len(tracking_store.get_client(sqlite_store).search_model_versions(f"name='{name}'")) == 2
    assert tracking_store.get_client(elsewhere).search_registered_models() == []


def test_lookup_returns_the_saved_weights_uncompiled(
    world: World, registered: dict[str, RegisteredModel]
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


def test_registered_artifacts_hold_no_pickles_and_no_paths_of_this_machine(
    world: World, registered: dict[str, RegisteredModel], sqlite_store: str, tmp_path: Path
) -> None:
    local = Path(
        mlflow.artifacts.download_artifacts(
            "models:/llamaflow-test/2", dst_path=str(tmp_path), tracking_uri=sqlite_store
        )
    )
    files = [p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()]
    assert not [
        f for f in files if f.endswith((".pt", ".pth", ".pkl", ".pickle", ".bin", ".joblib", ".ckpt"))
    ]
    assert [f for f in files if f.endswith(".safetensors")] == ["artifacts/model.safetensors"]
    assert "python_model.pkl" not in [Path(f).name for f in files]
    assert "code/model/llama.py" in files
    mlmodel = yaml.safe_load((local / "MLmodel").read_text())
    assert mlmodel["flavors"]["python_function"]["loader_module"] == "mlflow.pyfunc.loaders.code_model"
    assert "pyfunc.py" in files
    roots = [str(REPO), str(Path(world.trained.path).parent), str(Path(sqlite_store[10:]).parent)]
    assert mlmodel_absolute_paths(mlmodel, roots) == []
    requirements = (local / "requirements.txt").read_text()
    assert "+cpu" not in requirements and "torch>=" in requirements


def test_pyfunc_predicts_in_a_new_process_without_the_repo(
    registered: dict[str, RegisteredModel], sqlite_store: str, tmp_path: Path
) -> None:
    script = """
import importlib.util, json, os, sys
# No copy of the project may be importable (the worktree, or an editable install of another checkout).
sys.path[:] = [p for p in sys.path if not os.path.isfile(os.path.join(p or ".", "model", "__init__.py"))]
assert importlib.util.find_spec("model") is None, "the repo must not be importable here"
import mlflow
model = mlflow.pyfunc.load_model("models:/llamaflow-test@champion")
out = model.predict(["def ", ""], params={"max_new_tokens": 6, "temperature": 0.0})
again = model.predict(["def ", ""], params={"max_new_tokens": 6, "temperature": 0.0})
assert out == again, "greedy decoding must be deterministic"
print("RESULT" + json.dumps(out))
"""
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": sqlite_store,
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("PYTHONPATH", None)
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    print(f"new process load + 2 predicts: {time.perf_counter() - started:.1f} s -> {out}")
    assert len(out) == 2 and all(isinstance(text, str) and text for text in out)


def test_pyfunc_in_process_takes_dataframes_and_checks_params(
    registered: dict[str, RegisteredModel], sqlite_store: str
) -> None:
    import pandas as pd

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
    world: World, sqlite_store: str, tmp_path: Path
) -> None:
    code = tmp_path / "echo_model.py"
    code.write_text(
        "import mlflow\n"
        "class Echo(mlflow.pyfunc.PythonModel):\n"
        "    def predict(self, context, model_input, params=None):\n"
        "        return list(model_input)\n"
        "mlflow.models.set_model(Echo())\n"
    )
    mlflow.set_tracking_uri(sqlite_store)
    run_id = new_run("foreign")
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
    assert not ours.promoted and ours.champion_bits_per_byte is None
    tags = tracking_store.get_client().get_model_version("llamaflow-foreign", ours.version).tags
    assert tags[register.TAG_COMPARISON].startswith("not comparable: version 1 could not be downloaded")
    assert "is not a llamaflow model" in tags[register.TAG_COMPARISON]
    assert tags[register.TAG_CHAMPION_BITS_PER_BYTE] == "none"


def _delete_files_of(name: str, version: str) -> None:
    """The version's files vanish from the artifact store (a cleanup job, a lost bucket)."""
    import shutil

    location = tracking_store.get_client().get_model_version_download_uri(name, version)
    shutil.rmtree(location.removeprefix("file://"))


def test_a_champion_whose_files_are_gone_is_not_comparable_and_promotion_decides(
    world: World, sqlite_store: str
) -> None:
    name = "llamaflow-gone"
    client = tracking_store.get_client()
    # Scored on another validation text than ours: comparing needs its files.
    lost = _register(world, world.random_init, world.other_dataset, name)
    _delete_files_of(name, lost.version)

    kept = _register(world, world.trained, world.dataset, name)  # no crash, the decision recorded
    assert not kept.promoted and kept.champion_version == lost.version
    assert kept.champion_bits_per_byte is None
    tags = client.get_model_version(name, kept.version).tags
    assert tags[register.TAG_COMPARISON].startswith(f"not comparable: version {lost.version} could not be")
    assert "could not be compared" in client.get_model_version(name, kept.version).description
    assert str(client.get_model_version_by_alias(name, "champion").version) == lost.version

    taken = _register(world, world.half_trained, world.dataset, name, promotion="if_better_or_incomparable")
    assert taken.promoted and taken.champion_version == lost.version
    assert str(client.get_model_version_by_alias(name, "champion").version) == taken.version
    comparison = client.get_model_version(name, taken.version).tags[register.TAG_COMPARISON]
    assert comparison.endswith("promoted anyway (promotion='if_better_or_incomparable')")

    # A comparable, better champion keeps the alias unless promotion is "always".
    worse = _register(world, world.other_init, world.dataset, name, promotion="if_better_or_incomparable")
    assert not worse.promoted and worse.champion_bits_per_byte == taken.bits_per_byte
    forced = _register(world, world.other_init, world.dataset, name, promotion="always")
    assert forced.promoted and forced.bits_per_byte > forced.champion_bits_per_byte
    assert str(client.get_model_version_by_alias(name, "champion").version) == forced.version


@pytest.mark.parametrize(
    ("method", "key"),
    [
        ("set_model_version_tag", register.TAG_COMPARISON),  # before the alias moves
        ("set_model_version_tag", register.TAG_PROMOTED),  # after it moved
        ("set_tag", register.RUN_TAG_VERSION),  # after the decision
    ],
)
def test_a_retry_after_a_crash_in_the_decision_completes_it(
    world: World, sqlite_store: str, monkeypatch: pytest.MonkeyPatch, method: str, key: str
) -> None:
    """The process dies at one write of the decision (a failing call stands for it); the flow-run retry
    calls register_model again with the same run."""
    name = f"llamaflow-partial-{key.rsplit('.', 1)[1]}"
    kwargs = dict(
        run_id=new_run(name),
        checkpoint=world.half_trained,
        tokenizer=world.tokenizer,
        dataset=world.dataset,
        eval_result=score(world.half_trained, world.dataset, world.tokenizer),
        model_name=name,
        eval_device="cpu",
    )
    real = getattr(MlflowClient, method)

    def dies_once(self, *args):
        if key in args and not getattr(dies_once, "died", False):
            dies_once.died = True
            raise RuntimeError("the registering process died here")
        return real(self, *args)

    monkeypatch.setattr(MlflowClient, method, dies_once)
    with pytest.raises(RuntimeError, match="died here"):
        register.register_model(**kwargs)
    again = register.register_model(**kwargs)
    client = tracking_store.get_client()
    assert again.promoted and again.champion_version is None
    version = client.get_model_version(name, again.version)
    assert version.tags[register.TAG_COMPARISON] == "no previous champion"
    assert version.description.startswith(f"Version {again.version} became 'champion'")
    assert client.get_run(again.run_id).data.tags[register.RUN_TAG_VERSION] == f"{name}/{again.version}"
    assert str(client.get_model_version_by_alias(name, "champion").version) == again.version
    assert len(client.search_model_versions(f"name='{name}'")) == 1


def test_a_holder_that_stalls_past_its_lease_does_not_leave_its_late_alias_write(
    world: World, sqlite_store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registration A (the worse model) decides to promote, then its connection to the store hangs for
    longer than the lock's lease, renewals included. B (the better one) breaks A's lease, takes the alias
    and records it. Then A's alias write goes through: it must be undone, and A compared with B."""
    import threading

    name = "llamaflow-stalled"
    monkeypatch.setattr("tasks.registry.decision.LOCK_LEASE_S", 1.0)
    _register(world, world.random_init, world.dataset, name)
    runs = {label: new_run(f"stalled-{label}") for label in "AB"}
    checkpoints = {"A": world.half_trained, "B": world.trained}
    scores = {label: score(ckpt, world.dataset, world.tokenizer) for label, ckpt in checkpoints.items()}
    stalled, resume = threading.Event(), threading.Event()

    def stall_if_a(method: str):  # A's calls hang while stalled (A's thread and its lock-renewal thread)
        real = getattr(MlflowClient, method)

        def call(self, *args, **kwargs):
            if threading.current_thread().name.startswith("registrant-A") and not resume.is_set():
                if method == "set_registered_model_alias":
                    stalled.set()
                if stalled.is_set():
                    resume.wait(120)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(MlflowClient, method, call)

    stall_if_a("set_registered_model_alias")
    stall_if_a("set_model_version_tag")

    def registration(label: str) -> RegisteredModel:
        return register.register_model(
            run_id=runs[label],
            checkpoint=checkpoints[label],
            tokenizer=world.tokenizer,
            dataset=world.dataset,
            eval_result=scores[label],
            model_name=name,
            eval_device="cpu",
        )

    results: dict[str, RegisteredModel | BaseException] = {}

    def run_a() -> None:
        try:
            results["A"] = registration("A")
        except BaseException as exc:
            results["A"] = exc

    a = threading.Thread(target=run_a, name="registrant-A")
    a.start()
    assert stalled.wait(120), "A never reached its alias write"
    results["B"] = registration("B")  # waits out A's lease, then promotes B over version 1
    resume.set()
    a.join(120)
    assert not a.is_alive()
    first, second = results["A"], results["B"]
    assert isinstance(first, RegisteredModel), first
    client = tracking_store.get_client()
    assert str(client.get_model_version_by_alias(name, "champion").version) == second.version
    assert second.promoted and second.champion_version == "1"
    assert not first.promoted and first.champion_version == second.version


def test_bad_inputs_fail_before_anything_is_logged(world: World, sqlite_store: str, tmp_path: Path) -> None:
    run_id = new_run("bad")
    kwargs = dict(run_id=run_id, tokenizer=world.tokenizer, dataset=world.dataset, model_name="never")
    good = score(world.trained, world.dataset, world.tokenizer)
    empty = CheckpointRef(path=str(tmp_path), run_dir=str(tmp_path), step=0, tokens_seen=0)
    with pytest.raises(FileNotFoundError, match="lacks model.safetensors"):
        register.register_model(checkpoint=empty, eval_result=good, **kwargs)
    diverged = good.model_copy(update={"bits_per_byte": math.nan})
    with pytest.raises(ValueError, match="diverged"):
        register.register_model(checkpoint=world.trained, eval_result=diverged, **kwargs)
    other_data = score(world.trained, world.other_dataset, world.tokenizer)
    with pytest.raises(ValueError, match="measured on dataset"):
        register.register_model(checkpoint=world.trained, eval_result=other_data, **kwargs)
    assert "never" not in [m.name for m in tracking_store.get_client().search_registered_models()]


def test_eval_result_carries_what_promotion_compares(world: World) -> None:
    result = score(world.trained, world.dataset, world.tokenizer)
    assert isinstance(result, EvalResult)
    assert result.scored_bytes > result.scored_tokens > 0
    assert result.bits_per_byte == pytest.approx(
        result.val_loss * result.scored_tokens / math.log(2) / result.scored_bytes, rel=1e-12
    )
    assert (PAD_ID, EOS_ID) == (2, 1)


def test_a_tampered_champion_is_refused_by_every_loader(
    world: World, sqlite_store: str, home: Path, tmp_path: Path
) -> None:
    """The decision records the sha256 of every file it promoted; a file changed afterwards in the artifact
    store is named, and nothing is loaded: by lookup, by the pyfunc (MLflow's own loader) and by init_from."""
    from tasks.init_from.mlflow_source import resolve_registry
    from tasks.init_from.parent_cache import InitFromError
    from tasks.registry.manifest import TAG_MANIFEST, TamperedModelError, manifest_of, recorded

    name = "llamaflow-tamper"
    _register(world, world.random_init, world.dataset, name)
    client = tracking_store.get_client()
    version = client.get_model_version_by_alias(name, "champion")
    store_dir = Path(client.get_model_version_download_uri(name, version.version).removeprefix("file://"))
    assert recorded(version.tags) == manifest_of(store_dir) and "pyfunc.py" in version.tags[TAG_MANIFEST]
    uri = f"models:/{name}@champion"
    for target in ("artifacts/model.safetensors", "artifacts/tokenizer.json", "pyfunc.py", "MLmodel"):
        original = (store_dir / target).read_bytes()
        (store_dir / target).write_bytes(original + b"\n# changed\n")
        try:
            with pytest.raises(TamperedModelError, match=f"changed: {target}"):
                load_model(uri)
            with pytest.raises(InitFromError, match=f"changed: {target}"):
                resolve_registry(uri, sqlite_store)
            if target != "pyfunc.py":  # MLflow runs a changed pyfunc.py before any code of ours
                # (the model's own copy of the manifest module raises: its class, not ours)
                with pytest.raises(ValueError, match=f"changed: {target}"):
                    mlflow.pyfunc.load_model(uri)
        finally:
            (store_dir / target).write_bytes(original)
    (store_dir / "code" / "torch.py").write_text("raise SystemExit('shadowed')\n")  # a file added
    with pytest.raises(TamperedModelError, match="added: code/torch.py"):
        load_model(uri)
    (store_dir / "code" / "torch.py").unlink()
    load_model(uri)  # the recorded files load again
