"""The pruner's rungs and the tables: ASHA counts each trial's rung scores once however often it was taken
over; a cut trial records its rung, tokens and the scores it was compared with, and the tables keep final
full-validation scores and subset scores in separate columns (results, `status`, `status --json`, and
the parent run's rung decisions)."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from flows.sweep.claims import _take_over
from flows.sweep.rungs import PRUNED, Asha, decision
from flows.sweep.spec import check_spec
from flows.sweep.study import open_study


def _score(study: optuna.Study, value: float, step: int = 1) -> tuple[optuna.trial.Trial, bool]:
    """A new trial's score at `step`, and whether the pruner cuts it (it records the rung score as it
    decides: a second call would judge the next rung)."""
    trial = study.ask()
    trial.report(value, step)
    return trial, trial.should_prune()


def _scores_at_rung_0(pruner: optuna.pruners.BasePruner) -> tuple[optuna.Study, bool]:
    """Trials scoring 3 and 4 at the first rung, and one scoring 1 taken over twice (each takeover a new
    trial that inherits its origin's attributes, its rung scores too); then a trial scoring 2 there."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(pruner=pruner)
    _score(study, 3.0)
    _score(study, 4.0)
    _score(study, 1.0)
    for _ in range(2):
        (running,) = [t for t in study.get_trials() if t.state == TrialState.RUNNING and t.value is None][-1:]
        _take_over(study, running)
        study.ask()  # the sweep that takes it over runs the queued copy
    return study, _score(study, 2.0)[1]


def test_asha_counts_a_trial_taken_over_twice_once() -> None:
    """Of 4 trials (1, 2, 3, 4), halving keeps the best 2 at the rung: the one scoring 2 is kept. Read with
    the takeovers' copies (1, 1, 1, 2, 3, 4), it would be cut: Optuna's own pruner does."""
    _, cut = _scores_at_rung_0(optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2))
    assert cut  # what the sweep used to do
    study, cut = _scores_at_rung_0(Asha(min_resource=1, reduction_factor=2))
    assert not cut
    assert sum("completed_rung_0" in t.system_attrs for t in study.get_trials()) == 6  # the copies are there


def test_a_cut_trial_records_its_rung_tokens_and_the_scores_it_lost_to() -> None:
    study, _ = _scores_at_rung_0(Asha(min_resource=1, reduction_factor=2))
    weak, cut = _score(study, 5.0)
    assert cut
    assert decision(weak, step=1, tokens=256, value=5.0) == {
        "trial": weak.number,
        "rung": 0,
        "step": 1,
        "tokens": 256,
        "score": 5.0,
        "against": [{"trial": n, "score": s} for n, s in ((4, 1.0), (5, 2.0), (0, 3.0), (1, 4.0))],
    }


SPEC = {
    "name": "tables",
    "base": {"preset": "tiny", "eval_every": 10},
    "space": {"lr": {"choices": [0.001, 0.002, 0.003]}},
    "sampler": "grid",
    "pruner": "asha",
}


def test_final_and_subset_scores_never_share_a_column(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A finished trial's full validation score is `final`; a pruned trial's last subset score is `subset`,
    with its rung and tokens: in the results table, in `status` and in `status --json`."""
    from flows.sweep.cli import main
    from flows.sweep.report import markdown_table, trial_rows

    spec = {**SPEC, "storage": f"journal:{tmp_path / 'optuna.journal'}"}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    study = open_study(check_spec(spec))
    done = study.ask({"lr": optuna.distributions.CategoricalDistribution([0.001, 0.002, 0.003])})
    done.report(1.3, 10)
    study.tell(done, 1.1919)
    pruned = study.ask()
    pruned.report(1.051, 10)
    pruned.set_user_attr(
        PRUNED, {"trial": 1, "rung": 0, "step": 10, "tokens": 2560, "score": 1.051, "against": []}
    )
    study.tell(pruned, state=TrialState.PRUNED)
    rows = trial_rows(study)
    assert [(r["final"], r["subset"], r["rung"], r["tokens"]) for r in rows] == [
        (1.1919, None, None, None),
        (None, 1.051, 0, 2560),
    ]
    header = markdown_table(rows).splitlines()[0]
    assert "| final | subset | rung | tokens |" in header and "value" not in header

    assert main(["status", str(path)]) == 0
    lines = capsys.readouterr().out
    assert (
        "0 COMPLETE final 1.19190" in lines and "1 PRUNED   subset 1.05100 at rung 0, 2,560 tokens" in lines
    )
    assert main(["status", str(path), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert [(r["state"], r["final"], r["subset"], r["tokens"]) for r in record["rows"]] == [
        ("COMPLETE", 1.1919, None, None),
        ("PRUNED", None, 1.051, 2560),
    ]
    assert record["counts"]["complete"] == 1 and record["trials"] == 3


def test_the_parent_run_holds_the_rung_decisions_as_a_table(tmp_path: Path) -> None:
    from flows.sweep.report import log_results
    from tasks.tracking import store

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = store.get_client(uri)
    experiment = client.create_experiment("rungs", artifact_location=str(tmp_path / "artifacts"))
    parent = client.create_run(experiment).info.run_id
    spec = check_spec({**SPEC, "storage": f"journal:{tmp_path / 'optuna.journal'}"})
    study, _ = _scores_at_rung_0(Asha(min_resource=1, reduction_factor=2))
    weak, _ = _score(study, 5.0)
    weak.set_user_attr(PRUNED, decision(weak, step=1, tokens=256, value=5.0))
    study.tell(weak, state=TrialState.PRUNED)
    log_results(spec, study, parent, uri, plots=False)
    table = json.loads((tmp_path / "artifacts" / parent / "artifacts" / "rung_decisions.json").read_text())
    assert table["columns"] == ["trial", "rung", "step", "tokens", "score", "against"]
    ((trial, rung, step, tokens, score, against),) = table["data"]
    assert (trial, rung, step, tokens, score) == (weak.number, 0, 1, 256, 5.0)
    assert [a["score"] for a in json.loads(against)] == [1.0, 2.0, 3.0, 4.0]
