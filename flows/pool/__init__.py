"""Training placed on a Prefect work pool: where a run trains (placement), node groups across hosts (nodes),
what crosses between the flow and a node's worker (handoff), the flow a node runs (remote_train), and the
worker command that checks its credentials before it works (worker)."""
