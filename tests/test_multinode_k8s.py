"""`python -m flows.k8s`: the JobSet and TrainJob manifests it prints, validated against the CRDs' published
OpenAPI schemas (vendored in tests/k8s_schemas/, each with its source and commit), strictly: a field the
schema does not know is an error here, as `kubectl apply --validate=strict` makes it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from flows.k8s import main
from flows.node import build_parser, place_of

SCHEMAS = Path(__file__).parent / "k8s_schemas"


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever it lists an object's fields (Kubernetes prunes or
    refuses them; JSON Schema lets them through)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _validate(document: dict[str, Any], crd: str) -> None:
    vendored = json.loads((SCHEMAS / crd).read_text())
    assert document["apiVersion"] == f"{vendored['group']}/{vendored['version']}"
    assert document["kind"] == vendored["kind"]
    jsonschema.Draft7Validator(_strict(vendored["openAPIV3Schema"])).validate(document)


def _print(tmp_path: Path, capsys, *extra: str) -> dict[str, Any]:
    config = tmp_path / "shared" / "run.yaml"
    config.parent.mkdir()
    config.write_text(yaml.safe_dump({"preset": "tiny", "checkpoint_dir": str(tmp_path / "shared" / "run")}))
    argv = [str(config), "--nodes", "4", "--gpus-per-node", "8", "--mount", str(tmp_path / "shared"), *extra]
    assert main(argv) == 0, capsys.readouterr().err
    return yaml.safe_load(capsys.readouterr().out)


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container["env"]}


def test_the_jobset_manifest_fits_the_jobset_crd_and_runs_the_node_command(tmp_path: Path, capsys) -> None:
    document = _print(tmp_path, capsys, "--name", "llama7")
    _validate(document, "jobset.json")
    job = document["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"] == 4
    pod = job["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert _env(container)["LLAMAFLOW_HOME"] == f"{tmp_path}/shared/home"
    assert pod["terminationGracePeriodSeconds"] > 120  # the default stop_grace_s: the stop checkpoint fits
    # pod 2 as the Indexed Job starts it: the node command's place from JOB_COMPLETION_INDEX and its flags
    command = container["command"]
    assert command[:3] == ["python", "-m", "flows.node"], command
    place = place_of(build_parser().parse_args(command[3:]), {"JOB_COMPLETION_INDEX": "2"})
    assert (place.node_rank, place.nnodes, place.head, place.port) == (2, 4, "llama7-node-0-0.llama7", 29500)


def test_the_trainjob_manifest_fits_the_trainer_crd_and_reads_torchruns_variables(
    tmp_path: Path, capsys
) -> None:
    document = _print(tmp_path, capsys, "--trainjob", "--name", "llama7")
    _validate(document, "trainjob.json")
    trainer = document["spec"]["trainer"]
    assert trainer["numNodes"] == 4 and trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 8
    pet = {"PET_NNODES": "4", "PET_NODE_RANK": "3", "PET_MASTER_ADDR": "llama7-node-0-0.llama7"}
    place = place_of(build_parser().parse_args([*trainer["command"][3:], *trainer["args"]]), pet)
    assert (place.node_rank, place.nnodes, place.head, place.port) == (3, 4, "llama7-node-0-0.llama7", 29500)


def test_the_strict_schema_refuses_a_field_the_crd_does_not_know(tmp_path: Path, capsys) -> None:
    document = _print(tmp_path, capsys, "--name", "llama7")
    document["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8
    with pytest.raises(jsonschema.ValidationError, match="'gpus' was unexpected"):
        _validate(document, "jobset.json")


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--name", "Llama_7"], "is not a DNS label"),
        (["--mount", "/elsewhere"], "not under the shared claim's mount /elsewhere"),
    ],
)
def test_a_manifest_that_cannot_work_is_refused(tmp_path: Path, capsys, extra: list[str], says: str) -> None:
    config = tmp_path / "shared" / "run.yaml"
    config.parent.mkdir()
    config.write_text(yaml.safe_dump({"preset": "tiny", "checkpoint_dir": str(tmp_path / "shared" / "run")}))
    argv = [str(config), "--nodes", "2", "--gpus-per-node", "8", "--mount", str(tmp_path / "shared"), *extra]
    assert main(argv) == 2
    assert says in capsys.readouterr().err
