"""Run a sweep spec as a user does (`python -m flows.sweep SPEC`) and record what it cost and found.

    .venv/bin/python benchmarks/sweep_run.py benchmarks/sweeps/round10_muon_weight_decay.yaml --tag sweep_round10
    .venv/bin/python benchmarks/sweep_run.py benchmarks/sweeps/kill9.yaml --kill-after 2 --tag sweep_kill9

With `--kill-after N` the first sweep process is killed with SIGKILL once N trials are finished (and the
next one has a checkpoint), then the same command runs again: the record shows that the study ends with
exactly its `trials` trials and that the killed trial resumed from its checkpoint.

Output: benchmarks/results/<tag>.json: each process's wall time, every trial (values, state, score, steps,
seconds), the sum of the trials' seconds, the best configuration's command line, load averages, machine.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from optuna.trial import TrialState

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_common import RESULTS_DIR, ROOT, load_average, machine_info, write_json  # noqa: E402
from flows.sweep.command import pretrain_command  # noqa: E402
from flows.sweep.spec import SweepSpec, load_spec, trial_values  # noqa: E402
from flows.sweep.study import FINISHED, existing_study, trials_dir  # noqa: E402


def run(spec: SweepSpec, spec_path: Path, log: Path, kill_after: int | None) -> dict[str, Any]:
    """One `python -m flows.sweep` process; killed with SIGKILL after `kill_after` finished trials, once a
    running trial has written a checkpoint (so that its resumption shows)."""
    started = time.monotonic()
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "flows.sweep", str(spec_path)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    killed = False
    while process.poll() is None:
        time.sleep(2.0)
        if kill_after is not None and _ready_to_kill(spec, kill_after):
            process.send_signal(signal.SIGKILL)
            killed = True
            break
    process.wait()
    return {"wall_s": round(time.monotonic() - started, 1), "exit_code": process.returncode, "killed": killed}


def _ready_to_kill(spec: SweepSpec, finished: int) -> bool:
    study = existing_study(spec)
    if study is None or len(study.get_trials(deepcopy=False, states=FINISHED)) < finished:
        return False
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    directory = trials_dir(spec.name, study)
    return any(any((directory / f"trial-{t.number:03d}" / "run").glob("step_*")) for t in running)


def _resumed_from(directory: Path) -> int | None:
    log = directory / "output.log"
    found = (
        re.findall(r"resuming from checkpoint \S+ at step (\d+)", log.read_text()) if log.is_file() else []
    )
    return int(found[-1]) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", type=Path)
    parser.add_argument(
        "--kill-after", type=int, default=None, help="SIGKILL the first process after N trials"
    )
    parser.add_argument("--tag", default=None)
    args = parser.parse_args()
    spec = load_spec(args.spec)
    tag = args.tag or f"sweep_{spec.name}"
    log = RESULTS_DIR / f"{tag}.log"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    loads = {"before": load_average()}
    processes = [run(spec, args.spec, log, args.kill_after)]
    if processes[0]["killed"]:
        loads["at_kill"] = load_average()
        processes.append(run(spec, args.spec, log, None))
    loads["after"] = load_average()

    study = existing_study(spec)
    assert study is not None, f"no study {spec.name}: see {log}"
    trials = []
    for t in sorted(study.get_trials(), key=lambda t: t.number):
        directory = trials_dir(spec.name, study) / f"trial-{t.number:03d}"
        trials.append(
            {
                "number": t.number,
                "params": t.params,
                "state": t.state.name,
                "value": t.value,
                "last_score": t.intermediate_values[t.last_step] if t.last_step is not None else None,
                "steps": t.user_attrs.get("steps"),
                "seconds": t.user_attrs.get("seconds"),
                "resumed_from_step": _resumed_from(directory),
            }
        )
    complete = [t for t in trials if t["state"] == "COMPLETE"]
    best = min(complete, key=lambda t: t["value"]) if complete else None
    result = {
        "command": f"python -m flows.sweep {args.spec}",
        "spec": spec.model_dump(mode="json"),
        "processes": processes,
        "wall_s": sum(p["wall_s"] for p in processes),
        "trial_seconds": round(sum(t["seconds"] or 0.0 for t in trials), 1),
        "trials": trials,
        "counts": {
            s: sum(t["state"] == s for t in trials) for s in ("COMPLETE", "PRUNED", "FAIL", "RUNNING")
        },
        "best": best,
        "best_command": pretrain_command(trial_values(spec, best["params"])) if best else None,
        "load_average": loads,
        "threads": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
        "machine": machine_info(torch.device("cpu")),
    }
    RESULTS_DIR.mkdir(exist_ok=True)
    write_json(RESULTS_DIR / f"{tag}.json", result)
    print(
        f"{len(trials)} trials {result['counts']}; wall {result['wall_s']:.0f} s, trials {result['trial_seconds']:.0f} s"
    )
    if best:
        print(f"best: {best['params']} {best['value']:.5f}\n{result['best_command']}")


if __name__ == "__main__":
    main()
