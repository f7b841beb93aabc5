"""Multi-node training on a Prefect pool: `nnodes` runs of the train deployment, one per node, each running
torchrun for its node; the pretrain run starts them, waits for all, and cancels them all when it stops.

The pretrain side (`run_node_group`) starts node 0, then nodes 1..N-1 with node 0's flow-run id, and waits.
A node that fails ends the try: the others are cancelled, and once every node run has ended the group starts
again (`train_retries` times), resuming from the newest checkpoint. Cancelling the pretrain run cancels
every node run at once (Prefect's server would also cancel them, as deployment subflows, on its next
cancellation-cleanup pass, by default within 20 s).

The node side: node 0 gives the rendezvous endpoint (`rdzv_endpoint`, or its own address and a free port)
and publishes it as a label of its own flow run: the Prefect API is a store every node already reaches.
Before that it writes a token into the run directory; node k waits for the label (at most `rdzv_timeout_s`,
and not at all once node 0 has ended), then must see that token at the same path, or the checkpoint
directory is not shared and the job is refused before any rendezvous. Only node 0 sends metrics to MLflow
and hands the result back; global rank 0, wherever it runs, writes them into the shared run directory.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import urllib.parse
from pathlib import Path
from typing import Any
from uuid import UUID

from model.atomic import write_text_atomic
from tasks.network import is_loopback
from tasks.refs import DatasetRef, ModelRef
from tasks.training import TrainSettings
from tasks.training.rendezvous import ARRIVALS_DIR, NODE_ADDR_ENV, node_address, serve_store

ENDPOINT_LABEL = "llamaflow.rdzv_endpoint"
POLL_S = 1.0


class NodeError(RuntimeError):
    """A node of a multi-node job cannot take part (no endpoint from node 0, storage not shared)."""


def _log() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("llamaflow.nodes")


def _token(run_dir: str, node0_flow_run: str) -> Path:
    return Path(run_dir) / ARRIVALS_DIR / f"node0-{node0_flow_run}.json"


def _where(run_dir: str, model: ModelRef, dataset: DatasetRef) -> dict[str, str]:
    return {"run_dir": str(Path(run_dir).resolve()), "model": model.path, "dataset": dataset.path}


# ---------------------------------------------------------------- the node side (in remote-train)


def open_rendezvous(
    settings: TrainSettings, run_dir: str, model: ModelRef, dataset: DatasetRef, flow_run_id: str
) -> TrainSettings:
    """Node 0: the endpoint (given, or this machine's address toward the Prefect API and a free port),
    the token in the run directory, then the endpoint as a label of this flow run."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    endpoint = settings.rdzv_endpoint
    if endpoint is None:
        api_host = urllib.parse.urlparse(PREFECT_API_URL.value() or "").hostname or "127.0.0.1"
        address = node_address(api_host) or socket.gethostname()
        if is_loopback(address) and not os.environ.get(NODE_ADDR_ENV):
            raise NodeError(
                f"node 0: its address for the other nodes would be {address}, a loopback address (this worker "
                f"reaches the Prefect API at {api_host} over loopback), which other machines cannot reach: set "
                f"{NODE_ADDR_ENV} in the worker's environment to this machine's address on the network the "
                f"nodes share ({NODE_ADDR_ENV}=127.0.0.1 if every node runs on this machine), or give "
                "rdzv_endpoint"
            )
        endpoint = serve_store(address, 0, settings.rdzv_timeout_s)  # bound now, served until this run ends
    token = {"endpoint": endpoint, "host": socket.gethostname(), **_where(run_dir, model, dataset)}
    write_text_atomic(_token(run_dir, flow_run_id), json.dumps(token))
    with get_client(sync_client=True) as client:
        client.update_flow_run_labels(UUID(flow_run_id), {ENDPOINT_LABEL: endpoint})
    _log().info(f"node 0: rendezvous at {endpoint} for {settings.nnodes} nodes")
    return settings.model_copy(update={"rdzv_endpoint": endpoint})


def join_rendezvous(
    settings: TrainSettings,
    run_dir: str,
    model: ModelRef,
    dataset: DatasetRef,
    node: int,
    node0_flow_run: str,
) -> TrainSettings:
    """Node k: node 0's endpoint from its flow run's labels, after checking that this node sees node 0's
    run directory (the same files at the same paths)."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + settings.rdzv_timeout_s
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(UUID(node0_flow_run))
            endpoint = (run.labels or {}).get(ENDPOINT_LABEL)
            if endpoint:
                break
            state = run.state.name if run.state else "no state"
            if run.state is not None and run.state.is_final():
                raise NodeError(
                    f"node {node}: node 0 (flow run {run.name}, {node0_flow_run}) ended {state} before it "
                    "published the rendezvous endpoint; see its logs"
                )
            if time.monotonic() > deadline:
                raise NodeError(
                    f"node {node}: node 0 (flow run {run.name}, {node0_flow_run}) published no rendezvous "
                    f"endpoint within rdzv_timeout_s={settings.rdzv_timeout_s} s (it is {state}): every node "
                    "needs a free worker on the pool at once (start each node's worker with --limit 1)"
                )
            time.sleep(POLL_S)
    token_path = _token(run_dir, node0_flow_run)
    if not token_path.is_file():
        raise NodeError(
            f"node {node}: checkpoint directory {run_dir} is not shared with node 0: node 0 wrote {token_path.name} "
            f"there and this node ({socket.gethostname()}) does not see it. Put checkpoint_dir (LLAMAFLOW_HOME) on "
            "storage every node mounts at the same path (NFS, Lustre, a ReadWriteMany volume)"
        )
    token = json.loads(token_path.read_text())
    mine = _where(run_dir, model, dataset)
    differ = [
        f"{key}: node 0 {token.get(key)}, here {mine[key]}" for key in mine if token.get(key) != mine[key]
    ]
    if differ:
        raise NodeError(
            f"node {node}: the nodes see the shared storage at different paths ({'; '.join(differ)}); mount it "
            "at the same path on every node (the same LLAMAFLOW_HOME)"
        )
    _log().info(f"node {node}: joining node 0's rendezvous at {endpoint}")
    return settings.model_copy(update={"rdzv_endpoint": str(endpoint)})


# ---------------------------------------------------------------- the pretrain side


def run_node_group(
    deployment: str, parameters: dict[str, Any], settings: TrainSettings, *, retries: int, wait_s: float
) -> Any:
    """Run `settings.nnodes` flow runs of `deployment` (one per node) until all complete; returns node 0's
    FlowRun. A failed try is retried `retries` times, after every node run of it has ended."""
    for attempt in range(retries + 1):
        runs = _start(deployment, parameters, settings)
        failure = _wait(runs, time.monotonic() + wait_s, settings)
        if failure is None:
            return runs[0]
        if attempt == retries:
            raise NodeError(
                f"{failure}. Retries exhausted ({retries}); a rerun of the pretrain flow run resumes from the newest "
                "checkpoint"
            )
        _log().warning(
            f"{failure}; starting the {settings.nnodes} nodes again (retry {attempt + 1} of {retries}), "
            "from the newest checkpoint"
        )
    raise AssertionError("unreachable")


def _start(deployment: str, parameters: dict[str, Any], settings: TrainSettings) -> list[Any]:
    from prefect.deployments import run_deployment

    runs: list[Any] = []
    try:
        for node in range(settings.nnodes):
            node_parameters = {
                **parameters,
                "settings": settings,
                "retries": 0,  # a node cannot retry alone: the group does
                "node": node,
                "node0_flow_run": str(runs[0].id) if runs else None,
            }
            runs.append(
                run_deployment(
                    deployment,
                    parameters=node_parameters,
                    timeout=0,  # started, not awaited: `_wait` watches them all
                    as_subflow=True,
                    tags=[f"node-{node}"],
                )
            )
    except BaseException:
        _cancel([run.id for run in runs], "the pretrain run could not start every node")
        raise
    _log().info(
        f"training on {settings.nnodes} nodes: "
        + ", ".join(f"node {i} = flow run {run.name} ({run.id})" for i, run in enumerate(runs))
    )
    return runs


def _wait(runs: list[Any], deadline: float, settings: TrainSettings) -> str | None:
    """None when every node run completed; else why not, after cancelling the others and waiting (bounded)
    for all of them to end. Any exception (the pretrain run cancelled, Ctrl-C) cancels every node run."""
    from prefect.client.orchestration import get_client

    ids = [run.id for run in runs]
    try:
        with get_client(sync_client=True) as client:
            while True:
                current = [client.read_flow_run(i) for i in ids]
                ended = [r for r in current if r.state is not None and r.state.is_final()]
                bad = [r for r in ended if not r.state.is_completed()]
                if not bad and len(ended) == len(current):
                    return None
                if bad or time.monotonic() > deadline:
                    why = _describe(current, bad, settings)
                    _cancel([r.id for r in current if r not in ended], why)
                    lost = _wait_ended(client, ids, settings.stop_grace_s + 60)
                    return why + _mark_lost(client, ids, lost, settings.stop_grace_s + 60)
                time.sleep(2 * POLL_S)
    except BaseException:
        _cancel(ids, "the pretrain run stopped")
        raise


def _describe(current: list[Any], bad: list[Any], settings: TrainSettings) -> str:
    def one(index: int, run: Any) -> str:
        state = run.state.name if run.state else "no state"
        message = f": {run.state.message}" if bad and run in bad and run.state and run.state.message else ""
        waiting = run.state is not None and (run.state.is_scheduled() or run.state.is_pending())
        never = " (never started: no free worker took it)" if waiting else ""
        return f"node {index} (flow run {run.name}, {run.id}) {state}{never}{message}"

    if bad:
        first = next(i for i, r in enumerate(current) if r in bad)
        others = "; ".join(one(i, r) for i, r in enumerate(current) if i != first)
        return f"the {settings.nnodes}-node training failed: {one(first, current[first])}; cancelled the others ({others})"
    states = "; ".join(one(i, r) for i, r in enumerate(current))
    return f"the {settings.nnodes}-node training did not end in time ({states}); cancelled every node run"


def _cancel(ids: list[Any], why: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Cancelling

    with get_client(sync_client=True) as client:
        for flow_run_id in ids:
            run = client.read_flow_run(flow_run_id)
            if run.state is None or run.state.is_final():
                continue
            # A run no worker took has no process to stop; a running one is stopped by its worker (SIGTERM:
            # training checkpoints, then ends).
            waiting = run.state.is_scheduled() or run.state.is_pending()
            state = Cancelled if waiting else Cancelling
            client.set_flow_run_state(flow_run_id, state(message=why[:500]))


def _wait_ended(client: Any, ids: list[Any], timeout_s: float) -> list[Any]:
    """Until every node run has ended (its torchrun stopped, its lock released), at most `timeout_s`; returns
    the runs that had not ended by then."""
    deadline = time.monotonic() + timeout_s
    while True:
        runs = [client.read_flow_run(i) for i in ids]
        waiting = [r for r in runs if r.state is None or not r.state.is_final()]
        if not waiting or time.monotonic() >= deadline:
            return waiting
        time.sleep(POLL_S)


def _mark_lost(client: Any, ids: list[Any], lost: list[Any], waited_s: float) -> str:
    """Node runs that did not stop after their cancellation have nobody left to end them (their host, or
    their worker, is gone: no process reports for them): Crashed, so that the UI and the pool do not show
    them running forever. Returns what to add to the failure's description."""
    from prefect.states import Crashed

    for run in lost:
        message = f"did not stop within {waited_s:.0f} s of its cancellation: its host or worker is gone"
        client.set_flow_run_state(run.id, Crashed(message=message), force=True)
    nodes = ", ".join(f"node {ids.index(run.id)} (flow run {run.name})" for run in lost)
    return (
        f"; {nodes} did not stop within {waited_s:.0f} s (host or worker gone?): marked Crashed"
        if lost
        else ""
    )
