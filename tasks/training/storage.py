"""`checkpoint_dir` on an object store: `s3://bucket/prefix` (and any other fsspec URL: gs://, az://, ...).

No file system is shared: the run directory lives on node-local disk (`$LLAMAFLOW_HOME/remote-runs/<hash>`,
the "mirror"), where checkpoints are written as everywhere else (atomic rename, sha256 manifest), and the
object store holds the run's copy. This is how Composer (`save_folder: s3://...`) and Ray Train
(`storage_path`) do it: write a checkpoint locally, then upload it; on a (re)start, download the newest one.

  push  after each checkpoint the main rank uploads it: every file of the step, then `manifest.json` LAST
        (a step rewritten in place first loses its old manifest), then the run's own files (metrics.jsonl,
        the MLflow run record), then deletes the steps the local pruning removed (manifest first).
  pull  before training (`pull_newest`), the newest step whose manifest is in the store and which is not
        already in the mirror is downloaded (the files the manifest lists, the manifest last, into a private
        directory renamed into place) and its checksums verified; a damaged one is dropped, the next older
        one tried. The resume then takes the newest valid local checkpoint as always.

S3 has no atomic rename and no lock: a step is visible in the store exactly when its manifest is, and a
reader takes no step without it (an upload killed midway leaves a step without manifest, never taken, and
removed by the next push). One writer per checkpoint_dir is the scheduler's business (one job per run): the
run lock (`run_lock.py`) guards the mirror of one node only. Credentials come from the environment (the
AWS_* variables, AWS_ENDPOINT_URL for an S3-compatible server, ~/.aws): a URL carrying them is refused.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import fsspec

from model.atomic import atomic_dir, write_text_atomic
from tasks.training.checkpoint import (
    MANIFEST_FILE,
    checkpoint_dirs,
    checkpoint_files,
    checkpoint_name,
    checkpoint_problem,
    step_of,
)
from tasks.training.errors import TrainingInputError

REMOTE_FILE = "remote_checkpoint_dir.json"  # in the mirror: the URL it mirrors
RUN_FILES = ("metrics.jsonl", "mlflow_run.json", "init_from.json")  # the run's own files, pushed and pulled
MANIFEST = MANIFEST_FILE
_LOCAL = ("file", "local")


def is_remote(location: str | Path) -> bool:
    """Whether `location` is a URL of a store other than the local file system."""
    text = str(location)
    return "://" in text and fsspec.utils.get_protocol(text) not in _LOCAL


def check_url(url: str) -> None:
    """Refuse a store URL that carries credentials (they would be stored in the run and printed)."""
    netloc = url.split("://", 1)[1].split("/", 1)[0]
    if "@" in netloc:
        raise TrainingInputError(
            "checkpoint_dir: the URL carries credentials (user:secret@...); give the bucket alone "
            "(s3://bucket/prefix) and the credentials in the environment (AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for an S3-compatible server) or ~/.aws"
        )


def mirror_dir(url: str) -> Path:
    """The node-local run directory that mirrors store URL `url`."""
    from tasks.home import home  # where every run directory lives; imported late: the engine needs no home

    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return home() / "remote-runs" / f"{url.rstrip('/').rsplit('/', 1)[-1]}-{digest}"


def local_run_dir(location: str | Path) -> Path:
    """The local run directory of `checkpoint_dir` `location`: itself when it is a path, else the store
    URL's mirror (created, and marked with the URL so that checkpoint writes push to it)."""
    if not is_remote(location):
        return Path(location).resolve()
    url = str(location).rstrip("/")
    check_url(url)
    _check_reachable(RemoteRun(url))
    local = mirror_dir(url)
    local.mkdir(parents=True, exist_ok=True)
    write_text_atomic(local / REMOTE_FILE, json.dumps({"url": url}))
    return local


def _check_reachable(remote: RemoteRun) -> None:
    """Fail before any training when the store's package is missing or its bucket cannot be read (the
    first checkpoint upload would fail only after the first checkpoint_every steps)."""
    try:
        fs = remote.fs
    except ImportError as err:
        raise TrainingInputError(
            f"checkpoint_dir={remote.url}: {err}. For S3: pip install 'llamaflow[s3]'"
        ) from err
    bucket = remote.root.split("/", 1)[0]
    try:
        found = fs.exists(bucket)
    except OSError as err:  # PermissionError among them
        found, why = False, f" ({type(err).__name__}: {err})"
    else:
        why = ""
    if not found:
        raise TrainingInputError(
            f"checkpoint_dir={remote.url}: bucket {bucket!r} not found or not readable{why}: create it, or check "
            "the credentials and endpoint in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
            "AWS_ENDPOINT_URL)"
        )


def pull_newest(run_dir: Path) -> Path | None:
    """For the mirror of a store: the store's newest valid checkpoint, downloaded when the mirror lacks
    it (under the run lock, before the resume looks for one)."""
    remote = remote_of(run_dir)
    return None if remote is None else remote.pull(run_dir)


def push_checkpoint(run_dir: Path, written: Path) -> None:
    """For the mirror of a store: upload checkpoint `written` just published in `run_dir` (the main rank,
    after the pruning) and remove from the store the steps the mirror no longer keeps."""
    remote = remote_of(run_dir)
    if remote is not None:
        remote.push(written, {step for step, _ in checkpoint_dirs(run_dir)})


def remote_of(run_dir: Path) -> RemoteRun | None:
    """The store that run directory `run_dir` mirrors, if any."""
    marker = Path(run_dir) / REMOTE_FILE
    return RemoteRun(json.loads(marker.read_text())["url"]) if marker.is_file() else None


@dataclass(frozen=True)
class RemoteRun:
    url: str

    @cached_property
    def _fs_root(self) -> tuple[Any, str]:
        return fsspec.core.url_to_fs(self.url)

    @property
    def fs(self) -> Any:
        return self._fs_root[0]

    @property
    def root(self) -> str:
        return self._fs_root[1].rstrip("/")

    def steps(self) -> dict[int, bool]:
        """Every step directory in the store, and whether its manifest is there (published)."""
        self.fs.invalidate_cache()  # the listing another process (or an earlier incarnation) changed
        if not self.fs.exists(self.root):
            return {}
        found: dict[int, bool] = {}
        for entry in self.fs.ls(self.root, detail=False):
            step = step_of(entry.rstrip("/").rsplit("/", 1)[-1])
            if step is not None:
                found[step] = False
        for manifest in self.fs.glob(f"{self.root}/step_*/{MANIFEST}"):
            step = step_of(manifest.rsplit("/", 2)[-2])
            if step is not None:
                found[step] = True
        return found

    def push(self, step_dir: Path, kept: set[int]) -> None:
        """Upload checkpoint `step_dir` (manifest last) and the run's files; delete the store's steps older
        than it that are not in `kept` (the mirror's), and unpublished leftovers of killed uploads."""
        step = step_of(step_dir.name)
        assert step is not None, step_dir
        target = f"{self.root}/{step_dir.name}"
        before = self.steps()
        if before.get(step):  # the same step again (a stop right after a periodic save): unpublish first
            self.fs.rm_file(f"{target}/{MANIFEST}")
        for name in checkpoint_files(step_dir):
            self.fs.put_file(str(step_dir / name), f"{target}/{name}")
        self.fs.put_file(str(step_dir / MANIFEST), f"{target}/{MANIFEST}")
        for name in RUN_FILES:
            if (step_dir.parent / name).is_file():
                self.fs.put_file(str(step_dir.parent / name), f"{self.root}/{name}")
        for old, published in sorted(before.items()):
            if old < step and (old not in kept or not published):
                self._remove(old)

    def _remove(self, step: int) -> None:
        path = f"{self.root}/{checkpoint_name(step)}"
        if self.fs.exists(f"{path}/{MANIFEST}"):
            self.fs.rm_file(f"{path}/{MANIFEST}")  # unpublished first: no reader takes it from here on
        self.fs.rm(path, recursive=True)

    def pull(self, run_dir: Path) -> Path | None:
        """Download the store's newest published checkpoint that `run_dir` lacks; None when it holds none
        newer than the mirror's. A download that fails its checksums is dropped and the next older tried."""
        local = {step for step, path in checkpoint_dirs(run_dir) if checkpoint_problem(path) is None}
        for name in RUN_FILES:
            if not (run_dir / name).is_file() and self.fs.exists(f"{self.root}/{name}"):
                self.fs.get_file(f"{self.root}/{name}", str(run_dir / name))
        newest_local = max(local, default=-1)
        for step in sorted((s for s, published in self.steps().items() if published), reverse=True):
            if step <= newest_local:
                return None
            final = run_dir / checkpoint_name(step)
            try:
                with atomic_dir(final, replace=True, durable=True) as staged:
                    self.download(f"{self.root}/{final.name}", staged.path)
                    problem = checkpoint_problem(staged.path)
                    if problem is not None:
                        raise _Damaged(problem)
            except _Damaged as damaged:
                warnings.warn(f"skipping {self.url}/{final.name}: {damaged}", RuntimeWarning, stacklevel=2)
                continue
            return final
        return None

    def download(self, remote: str, target: Path) -> None:
        """The files checkpoint `remote`'s manifest lists, then the manifest, into directory `target`."""
        manifest = self.fs.cat_file(f"{remote}/{MANIFEST}")
        for name in json.loads(manifest)["sha256"]:
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(f"{remote}/{name}", str(target / name))
        (target / MANIFEST).write_bytes(manifest)


class _Damaged(RuntimeError):
    """A downloaded checkpoint that does not match its manifest."""


def fetch_checkpoint(url: str) -> Path:
    """A local copy of the checkpoint at store URL `url` (a step_* prefix), verified against its manifest:
    `init_from` and consolidation read it. Cached by URL (a published step never changes but by a rewrite
    of the same step, which the manifest check catches)."""
    from tasks.home import cache_dir

    url = url.rstrip("/")
    check_url(url)
    remote = RemoteRun(url)
    if not remote.fs.exists(f"{remote.root}/{MANIFEST}"):
        published = sorted(step for step, done in remote.steps().items() if done)
        if published:
            newest = f"{url}/{checkpoint_name(published[-1])}"
            raise TrainingInputError(
                f"{url} is a run's checkpoint_dir (newest checkpoint {newest}): give one of its checkpoints "
                f"({newest}) to start from its weights, or resume the run with checkpoint_dir={url}"
            )
        raise TrainingInputError(
            f"{url} holds no {MANIFEST}: not a published checkpoint (a step_* prefix whose upload finished)"
        )
    local = cache_dir() / "remote-checkpoints" / hashlib.sha256(url.encode()).hexdigest()[:32]
    published = remote.fs.cat_file(f"{remote.root}/{MANIFEST}")
    if local.is_dir() and (local / MANIFEST).read_bytes() == published and checkpoint_problem(local) is None:
        return local
    with atomic_dir(local, replace=True) as staged:
        remote.download(remote.root, staged.path)
        problem = checkpoint_problem(staged.path)
        if problem is not None:
            raise TrainingInputError(f"{url}: {problem}")
    return local


def upload_file(path: Path, url: str) -> str:
    """Put local file `path` at store URL `url` (a consolidated model.safetensors beside its slices: not in
    the manifest, as locally)."""
    remote = RemoteRun(url)
    remote.fs.put_file(str(path), remote.root)
    return url
