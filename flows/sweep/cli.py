"""`python -m flows.sweep`: run a sweep, show where it stands, or stop it.

    python -m flows.sweep SPEC.yaml [--register]   # run it (or continue it: the same command after a stop)
    python -m flows.sweep status SPEC.yaml [--json] # its trials (final and subset scores apart), owners
    python -m flows.sweep stop SPEC.yaml           # every process running it stops its trials and ends

Exit codes as `python -m flows.pretrain`: 0 done, 1 failed, 2 bad input, 130 stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import optuna
from pydantic import ValidationError

from flows.cli import describe_validation_error, end_quietly
from flows.sweep.claims import owner_gone, request_stop, stop_requested
from flows.sweep.flow import sweep
from flows.sweep.report import trial_row, trial_rows
from flows.sweep.spec import SweepSpec, load_spec
from flows.sweep.study import (
    HEARTBEAT,
    OWNER,
    STOP_REQUESTED,
    SpecChangedError,
    counts,
    existing_study,
    home_free,
    storage_url,
)
from tasks.credentials import redact
from tasks.home import apply_embedded_defaults

COMMANDS = ("status", "stop")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else "run"
    parser = argparse.ArgumentParser(
        prog=f"python -m flows.sweep{'' if command == 'run' else ' ' + command}",
        description={
            "run": "Search PretrainConfig values with Optuna (status SPEC, stop SPEC: see where a sweep "
            "stands, stop it).",
            "status": "Show a sweep's trials and who runs them.",
            "stop": "Stop every process running the sweep (each trial after a checkpoint); rerun to continue.",
        }[command],
    )
    parser.add_argument("spec", type=Path, help="YAML sweep spec (see flows/sweep/spec.py)")
    if command == "run":
        parser.add_argument(
            "--register",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="Train and register the winner under the base's model name (default: the spec's "
            "`register_winner`)",
        )
    if command == "status":
        parser.add_argument("--json", action="store_true", help="Print it as one JSON object")
    args = parser.parse_args(argv if command == "run" else argv[1:])
    apply_embedded_defaults()
    try:
        spec = load_spec(args.spec)
    except ValidationError as err:
        print(f"invalid sweep spec {args.spec}:\n{describe_validation_error(err)}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as err:
        print(f"invalid sweep spec: {err}", file=sys.stderr)
        return 2
    started = time.time()
    try:
        if command == "status":
            return status(spec, as_json=args.json)
        if command == "stop":
            return stop(spec)
        sweep(spec, register_winner=args.register)
    except KeyboardInterrupt as err:
        # Prefect raises a trial task's interruption rather than the sweep's own: the study says why.
        why = "`python -m flows.sweep stop` was run" if _stop_asked(spec, started) else err or "interrupted"
        end_quietly(f"stopped: {why}; run the same command again to continue the sweep")
        return 130
    except SpecChangedError as err:
        end_quietly(f"error: {redact(str(err))}")
        return 2
    except Exception as err:  # a storage's or a store's error may quote its URL, password and all
        end_quietly(f"error: {redact(str(err) or type(err).__name__)}")
        return 1
    return 0


def _stop_asked(spec: SweepSpec, since: float) -> bool:
    with contextlib.suppress(Exception):  # the storage gone too: it was not `stop`
        study = existing_study(spec)
        return study is not None and stop_requested(study, since)
    return False


def _not_started(spec: SweepSpec) -> int:
    print(f"sweep {spec.name}: no study in {home_free(storage_url(spec))} (not started)", file=sys.stderr)
    return 1


def stop(spec: SweepSpec) -> int:
    study = existing_study(spec)
    if study is None:
        return _not_started(spec)
    request_stop(study)
    print(
        f"sweep {spec.name}: stop requested; each process running it stops its trials (after a checkpoint) "
        "and ends within seconds. Run the sweep's command again to continue it"
    )
    return 0


def status(spec: SweepSpec, as_json: bool = False) -> int:
    study = existing_study(spec)
    if study is None:
        return _not_started(spec)
    if as_json:
        print(json.dumps(status_record(spec, study), default=str))
        return 0
    url = home_free(storage_url(spec))
    done = counts(study)
    print(f"sweep {spec.name}: study in {url}")
    print("trials: " + ", ".join(f"{n} {state}" for state, n in done.items() if n) + f" (of {spec.n_trials})")
    if (asked := study.user_attrs.get(STOP_REQUESTED)) is not None:
        print(f"stop requested at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(float(asked)))}")
    for trial in study.get_trials(deepcopy=False):
        print("  " + _trial_line(trial))
    if (confirmation := existing_study(spec, suffix=".confirm")) is not None:
        print("confirmation: " + ", ".join(f"{n} {s}" for s, n in counts(confirmation).items() if n))
    dashboard = url.removeprefix("journal:")
    print(f"dashboard: pip install optuna-dashboard && optuna-dashboard {dashboard}")
    return 0


def status_record(spec: SweepSpec, study: optuna.Study) -> dict[str, Any]:
    """`status --json`: the results table's rows (final and subset scores in their own fields), each with
    who runs it and its message."""
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    rows = []
    for row in trial_rows(study):
        attrs = trials[row["trial"]].user_attrs
        owner = attrs.get(OWNER) if row["state"] == "RUNNING" else None
        rows.append(
            {**row, "owner": owner, "heartbeat": attrs.get(HEARTBEAT), "message": attrs.get("message")}
        )
    confirmation = existing_study(spec, suffix=".confirm")
    return {
        "name": spec.name,
        "storage": home_free(storage_url(spec)),
        "trials": spec.n_trials,
        "counts": counts(study),
        "stop_requested": study.user_attrs.get(STOP_REQUESTED),
        "rows": rows,
        "confirmation": counts(confirmation) if confirmation is not None else None,
    }


def _trial_line(trial: optuna.trial.FrozenTrial) -> str:
    attrs = trial.user_attrs
    row = trial_row(trial)
    line = f"{trial.number:3d} {trial.state.name:8s}"
    if row["final"] is not None:
        line += f" final {row['final']:.5f}"
    elif row["subset"] is not None:
        cut = f" at rung {row['rung']}, {row['tokens']:,} tokens" if row["rung"] is not None else ""
        line += f" subset {row['subset']:.5f}{cut}"
    line += f" {trial.params}"
    if "steps" in attrs:
        line += f", {attrs['steps']} steps in {attrs.get('seconds', 0):,.0f} s"
    if trial.state == optuna.trial.TrialState.RUNNING:
        owner = attrs.get(OWNER) or {}
        beat = time.time() - float(attrs.get(HEARTBEAT, 0.0))
        who = "released" if owner.get("released") else f"{owner.get('host')} pid {owner.get('pid')}"
        line += f", run by {who}, heartbeat {beat:,.0f} s ago" + (
            " (stale: the next sweep adopts it)" if owner_gone(trial) else ""
        )
    if "mlflow_run_id" in attrs:
        line += f", MLflow run {attrs['mlflow_run_id']}"
    if attrs.get("message"):
        line += f": {attrs['message'][-120:]}"
    return line
