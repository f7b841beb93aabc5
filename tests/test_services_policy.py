"""What a leaked worker credential can do to `@champion` on the real stores of `flows.services` (one `up` for
the module, loopback, no flags but the PostgreSQL owner): nothing. A tiny version registered by the worker and
promoted by the promoter (its decision records the sha256 manifest of the files), then raw HTTP as the worker,
in every shape a client can send: PUT, multipart uploads and DELETE onto the champion's files, registry
DELETEs, renames and stage transitions, the promotion lock, bodies that are not JSON or JSON without its
Content-Type, a query string beside a body. Every one is refused and the champion's files, tags and alias are
unchanged.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch

from flows import services as stores
from model import LlamaForPretraining, get_preset
from registry_world import save_checkpoint
from tasks.refs import TokenizerRef
from tasks.registry.manifest import TAG_MANIFEST, recorded

pytestmark = pytest.mark.e2e
PG_OWNER = "daemon"
NAME = "llamaflow-tiny"  # a default model: the worker and the promoter hold grants on it


def _read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def _tokenizer(root: Path) -> TokenizerRef:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<bos>": 0, "<eos>": 1, "<pad>": 2, "<unk>": 3, **{f"w{i}": 4 + i for i in range(60)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = root / "tokenizer.json"
    tokenizer.save(str(path))
    return TokenizerRef(path=str(path), fingerprint="t", vocab_size=64, bos_id=0, eos_id=1, pad_id=2)


@pytest.fixture(scope="module")
def stack() -> Iterator[dict]:
    """The stores, the worker's and the promoter's env, and a champion: registered by the worker, promoted
    by the promoter's decision."""
    from mlflow.tracking import MlflowClient

    from tasks.registry.decision import decide
    from tasks.registry.promoter import promoter_client
    from tasks.registry.publish import log_version

    base = Path(tempfile.mkdtemp(prefix="llamaflow-policy-"))
    base.chmod(0o755)  # PostgreSQL runs as PG_OWNER, who must enter it
    root = base / "stores"
    try:
        services = stores.up(root, pg_user=PG_OWNER, mlflow_workers=1, timeout_s=600)
        worker = _read_env(stores.add_user(services, "worker"))
        promoter = _read_env(stores.add_user(services, "promoter", promoter=True))
        uri = services.mlflow_tracking_uri
        with pytest.MonkeyPatch.context() as patch:
            for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
                patch.setenv(key, worker[key])
            for key in ("LLAMAFLOW_PROMOTER_USERNAME", "LLAMAFLOW_PROMOTER_PASSWORD"):
                patch.setenv(key, promoter[key])
            client = MlflowClient(uri, uri)
            run_id = client.create_run(client.get_experiment_by_name(NAME).experiment_id).info.run_id
            torch.manual_seed(0)
            model = LlamaForPretraining(get_preset("tiny", vocab_size=64, max_position_embeddings=64))
            checkpoint = save_checkpoint(base / "checkpoint", model)
            version = log_version(
                client,
                run_id=run_id,
                checkpoint=checkpoint,
                tokenizer=_tokenizer(base),
                model_name=NAME,
                tags={},
                via_server=True,
            )
            decide(
                promoter_client(uri),
                version,
                1.0,
                lambda _: (None, "unused"),
                alias="champion",
                promotion="if_better",
                record="{}",
            )
            champion = client.get_model_version_by_alias(NAME, "champion")
            logged = client.get_logged_model(champion.model_id or champion.source.removeprefix("models:/"))
            yield {
                "services": services,
                "uri": uri,
                "worker": (worker["MLFLOW_TRACKING_USERNAME"], worker["MLFLOW_TRACKING_PASSWORD"]),
                "champion": champion,
                "logged": logged,
                "client": client,
            }
    finally:
        stores.down(root)
        shutil.rmtree(base, ignore_errors=True)


def _artifact_url(stack: dict, relative: str) -> str:
    location = stack["logged"].artifact_location.removeprefix("mlflow-artifacts:/")
    return f"{stack['uri']}/api/2.0/mlflow-artifacts/artifacts/{location}/{relative}"


def _files(stack: dict, tmp: Path) -> dict[str, str]:
    import mlflow

    from tasks.registry.manifest import manifest_of

    local = mlflow.artifacts.download_artifacts(
        artifact_uri=stack["logged"].artifact_location, dst_path=str(tmp), tracking_uri=stack["uri"]
    )
    return manifest_of(Path(local))


def test_the_decision_records_the_manifest_of_the_files_it_promoted(stack: dict, tmp_path: Path) -> None:
    expected = recorded(stack["champion"].tags)
    assert expected is not None and {"pyfunc.py", "MLmodel", "artifacts/model.safetensors"} <= set(expected)
    assert _files(stack, tmp_path) == expected


def test_a_worker_cannot_change_the_champions_files_in_any_shape(stack: dict, tmp_path: Path) -> None:
    auth, mpu = stack["worker"], "/api/2.0/mlflow-artifacts/mpu/"
    location = stack["logged"].artifact_location.removeprefix("mlflow-artifacts:/")
    evil = b"import os; os.system('id')\n"
    attempts = {}
    for target in ("pyfunc.py", "artifacts/model.safetensors", "MLmodel", "code/model/llama.py"):
        url = _artifact_url(stack, target)
        attempts[f"PUT {target}"] = lambda url=url: requests.put(url, data=evil, auth=auth, timeout=60)
        attempts[f"PUT {target} as JSON"] = lambda url=url: requests.put(
            url, json={"x": 1}, auth=auth, timeout=60
        )
        attempts[f"multipart POST {target}"] = lambda url=url: requests.post(
            url, files={"file": ("pyfunc.py", evil)}, auth=auth, timeout=60
        )
        attempts[f"DELETE {target}"] = lambda url=url: requests.delete(url, auth=auth, timeout=60)
        for step in ("create", "complete", "abort"):
            mpu_url = f"{stack['uri']}{mpu}{step}/{location}/{target}"
            body = {"path": target, "num_parts": 1, "upload_id": "u", "parts": []}
            attempts[f"multipart upload {step} {target}"] = lambda u=mpu_url, b=body: requests.post(
                u, json=b, auth=auth, timeout=60
            )
    new_file = _artifact_url(stack, "code/torch.py")  # a module that would shadow torch at load
    attempts["PUT a new file"] = lambda: requests.put(new_file, data=evil, auth=auth, timeout=60)
    reopen = f"{stack['uri']}/api/2.0/mlflow/logged-models/{stack['logged'].model_id}"
    attempts["finalize it PENDING again"] = lambda: requests.patch(
        reopen,
        json={"model_id": stack["logged"].model_id, "status": "LOGGED_MODEL_PENDING"},
        auth=auth,
        timeout=60,
    )
    answers = {what: attempt().status_code for what, attempt in attempts.items()}
    assert {what: code for what, code in answers.items() if code != 403} == {}
    assert _files(stack, tmp_path) == recorded(stack["champion"].tags)


def test_a_worker_cannot_delete_rename_or_transition_or_touch_the_lock_in_any_shape(stack: dict) -> None:
    auth, api, version = stack["worker"], f"{stack['uri']}/api/2.0/mlflow", stack["champion"].version
    champion = {"name": NAME, "version": version}
    attempts = {
        "DELETE the version (JSON)": ("DELETE", "model-versions/delete", {"json": champion}),
        "DELETE the model (JSON)": ("DELETE", "registered-models/delete", {"json": {"name": NAME}}),
        "DELETE the alias (query)": (
            "DELETE",
            "registered-models/alias",
            {"params": {"name": NAME, "alias": "champion"}},
        ),
        "DELETE the manifest tag (query)": (
            "DELETE",
            "model-versions/delete-tag",
            {"params": {**champion, "key": TAG_MANIFEST}},
        ),
        "DELETE a version, text/plain body, scratch in the query": (
            "DELETE",
            "model-versions/delete",
            {
                "params": {"name": "scratch", "version": "1"},
                "data": json.dumps(champion),
                "headers": {"Content-Type": "text/plain"},
            },
        ),
        "DELETE a version, text/plain body": (
            "DELETE",
            "model-versions/delete",
            {"data": json.dumps(champion), "headers": {"Content-Type": "text/plain"}},
        ),
        "DELETE a version, no Content-Type": (
            "DELETE",
            "model-versions/delete",
            {"data": json.dumps(champion).encode()},
        ),
        "set a tag, query plus JSON body": (
            "POST",
            "model-versions/set-tag",
            {"params": {**champion, "key": "note"}, "json": {**champion, "key": "note", "value": "x"}},
        ),
        "forge the manifest, text/plain": (
            "POST",
            "model-versions/set-tag",
            {
                "data": json.dumps({**champion, "key": TAG_MANIFEST, "value": "{}"}),
                "headers": {"Content-Type": "text/plain"},
            },
        ),
        "rename the model": (
            "POST",
            "registered-models/rename",
            {"json": {"name": NAME, "new_name": "gone"}},
        ),
        "transition a stage": (
            "POST",
            "model-versions/transition-stage",
            {"json": {**champion, "stage": "Archived", "archive_existing_versions": False}},
        ),
        "create a lock of its own": (
            "POST",
            "registered-models/create",
            {"json": {"name": "mine.promotion-lock"}},
        ),
        "take a lock ticket": (
            "POST",
            "model-versions/create",
            {"json": {"name": f"{NAME}.promotion-lock", "source": "llamaflow:/promotion-lock"}},
        ),
        "delete the lock": (
            "DELETE",
            "registered-models/delete",
            {"json": {"name": f"{NAME}.promotion-lock"}},
        ),
    }
    answers = {
        what: requests.request(method, f"{api}/{route}", auth=auth, timeout=60, **kwargs).status_code
        for what, (method, route, kwargs) in attempts.items()
    }
    assert {what: code for what, code in answers.items() if code != 403} == {}
    after = stack["client"].get_model_version_by_alias(NAME, "champion")
    assert (after.version, after.tags) == (stack["champion"].version, stack["champion"].tags)
    # what the worker does every day still passes: JSON with its Content-Type
    note = requests.post(
        f"{api}/model-versions/set-tag",
        json={**champion, "key": "note", "value": "ok"},
        auth=auth,
        timeout=60,
    )
    assert note.status_code == 200, note.text
