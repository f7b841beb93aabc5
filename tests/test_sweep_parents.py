"""A sweep's parent is pinned once per study: `init_from: models:/NAME@ALIAS` is resolved when the study is
created, recorded in it, and every trial, confirmation run and the winner start from that version, even
after the alias moved (a nightly promotion during the sweep)."""

from __future__ import annotations

from pathlib import Path

import optuna

from flows.sweep.loop import plan as _plan
from flows.sweep.parents import PARENTS, pin_parents
from flows.sweep.runs import SweepContext
from flows.sweep.spec import check_spec
from tasks.tracking import store


def test_every_run_of_a_study_starts_from_the_version_its_alias_named_when_the_study_began(
    tmp_path: Path,
) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = store.get_client(uri)
    client.create_registered_model("parent")
    for _ in range(2):
        client.create_model_version("parent", source=str(tmp_path), run_id=None)
    client.set_registered_model_alias("parent", "champion", "1")
    spec = check_spec(
        {
            "name": "pinned",
            "base": {"preset": "tiny", "init_from": "models:/parent@champion"},
            "space": {"lr": {"choices": [0.001, 0.002]}},
            "sampler": "grid",
            "seeds": [1, 2],
        }
    )
    study = optuna.create_study()
    assert pin_parents(spec, study, uri) == {"models:/parent@champion": "models:/parent/1"}
    assert study.user_attrs[PARENTS]["models:/parent@champion"]["pinned"] == "models:/parent/1"

    client.set_registered_model_alias("parent", "champion", "2")  # promoted while the sweep runs
    pins = pin_parents(spec, study, uri)  # the sweep started again: the study's pin holds
    assert pins == {"models:/parent@champion": "models:/parent/1"}
    ctx = SweepContext(spec, uri, "parent-run", "http://api", None, "uid", tmp_path, pins)
    plans = [
        _plan(ctx, 0, "search", {"lr": 0.001}, "trial-000", {}, False, "k0"),
        _plan(ctx, 0, "confirm", {"lr": 0.002}, "confirm-x-seed1", {"seed": 1}, False, "k1"),
        _plan(ctx, 0, "confirm", {}, "confirm-base-seed1", {"seed": 1}, False, "k2"),
        _plan(ctx, -1, "winner", {"lr": 0.002}, "winner", {}, False, "k3"),
    ]
    assert {p.values["init_from"] for p in plans} == {"models:/parent/1"}
    # A new study (another sweep) pins what the alias names now.
    assert pin_parents(spec, optuna.create_study(), uri) == {"models:/parent@champion": "models:/parent/2"}
