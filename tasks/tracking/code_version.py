"""Which code trained: the git commit of this checkout, recorded on every run.

MLflow guesses the commit from a git repository around `sys.argv[0]`; under a Prefect worker that is
Prefect's engine in site-packages, so runs started by a worker had none. The commit is taken from where
this package's code is (a git clone made by the deployment's pull step, or a developer's checkout), else
from pip's record of a `pip install git+URL@COMMIT`, else from `LLAMAFLOW_GIT_COMMIT` (e.g. set when a
container image is built).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from importlib import metadata

from tasks.home import PROJECT_ROOT

COMMIT_TAG = "mlflow.source.git.commit"
DIRTY_TAG = "llamaflow.git_dirty"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _installed_commit() -> str | None:
    try:
        direct_url = metadata.distribution("llamaflow").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    return json.loads(direct_url or "{}").get("vcs_info", {}).get("commit_id")


@functools.cache
def code_version_tags() -> dict[str, str]:
    """`mlflow.source.git.commit` (and whether tracked files had local changes), or nothing if unknown."""
    if (PROJECT_ROOT / ".git").exists() and (head := _git("rev-parse", "HEAD")):
        status = _git("status", "--porcelain", "--untracked-files=no")
        tags = {COMMIT_TAG: head.strip()}
        if status is not None:
            tags[DIRTY_TAG] = str(bool(status.strip())).lower()
        return tags
    commit = _installed_commit() or os.environ.get("LLAMAFLOW_GIT_COMMIT")
    return {COMMIT_TAG: commit} if commit else {}
