"""Sweep agents side by side: two processes on one study each draw from a stream of their own (no random
configuration twice, each trial's seed recorded), and two sweeps on one host never lease the same GPU (a
lock file per device, dropped by the kernel when its holder dies). No training: Optuna and the leases alone."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import optuna

from flows.sweep.claims import claim_next
from flows.sweep.gpus import GpuPool
from flows.sweep.spec import check_spec
from flows.sweep.study import SAMPLER_SEED, open_study, suggest

SPEC = {
    "name": "agents",
    "base": {"preset": "tiny"},
    "space": {"lr": {"low": 1e-4, "high": 1e-2, "log": True}, "warmup_steps": {"low": 0, "high": 20}},
    "sampler": "random",
    "trials": 12,
}


def test_two_sweep_processes_on_one_study_never_draw_the_same_configuration(tmp_path: Path) -> None:
    """Two sweep processes started together (two storages on one journal file, each opening the study as a
    process does) claim trials in turn: every trial's values are its own, drawn with a seed of its own."""
    spec = check_spec({**SPEC, "storage": f"journal:{tmp_path / 'optuna.journal'}"})
    agents = [open_study(spec), open_study(spec)]
    for turn in range(spec.n_trials):
        study = agents[turn % 2]
        claimed = claim_next(study, spec.n_trials, set(), lambda t, s=study: suggest(t, spec))
        assert claimed is not None
        study.tell(claimed.trial, 1.0)
    trials = agents[0].get_trials()
    assert len(trials) == spec.n_trials
    drawn = [tuple(sorted(t.params.items())) for t in trials]
    assert len(set(drawn)) == len(drawn), drawn
    assert len({t.user_attrs[SAMPLER_SEED] for t in trials}) == len(trials)
    # A rerun draws trial N as the first run did (the seed is the study's trial number's, not the process's).
    again = optuna.create_study(sampler=optuna.samplers.RandomSampler())
    for t in trials[:3]:
        while len(again.trials) < t.number:
            again.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL))
        assert suggest(again.ask(), spec) == t.params


def test_two_sweeps_on_one_host_never_lease_the_same_gpu(tmp_path: Path) -> None:
    ours, theirs = GpuPool(["0", "1", "2"], 1, locks=tmp_path), GpuPool(["0", "1", "2"], 2, locks=tmp_path)
    assert ours.take() == ["0"]
    assert theirs.take() == ["1", "2"]
    stopping = threading.Event()
    threading.Timer(0.3, stopping.set).start()
    assert ours.take(stopping, poll_s=0.1) == []  # none free: it waits, and gives up when its sweep stops
    theirs.give_back(["1"])
    assert ours.take() == ["1"]

    # A sweep in another process holds GPU 3 until it is killed: the kernel drops its lease.
    pool = GpuPool(["3"], 1, locks=tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(tmp_path / 'gpu-3.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        stopped = threading.Event()
        stopped.set()
        assert pool.take(stopped, poll_s=0.01) == []
    finally:
        holder.kill()
        holder.wait()
    assert pool.take() == ["3"]
