"""A Prefect event for each promotion decision, for automations (notify on promotion, deploy the new
champion, page on a rejected nightly). Sent inside a Prefect run or when PREFECT_API_URL is set; a plain
call without either sends nothing (Prefect would start a temporary server just for it).

    event     llamaflow.model.promoted | llamaflow.model.rejected
    resource  mlflow.model-version.<name>.<version>   (labels: model name, version, alias)
    related   mlflow.run.<run id>
    payload   model_name, version, alias, bits_per_byte, champion_bits_per_byte, champion_version, comparison
"""

from __future__ import annotations

import logging
from typing import Any

from tasks.refs import RegisteredModel

PROMOTED = "llamaflow.model.promoted"
REJECTED = "llamaflow.model.rejected"


def resource_id(name: str, version: str) -> str:
    return f"mlflow.model-version.{name}.{version}"


def emit_decision(registered: RegisteredModel, comparison: str) -> Any:
    """Send the decision as a Prefect event; returns the event, or None when there is nowhere to send it."""
    from prefect.events import emit_event
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_API_URL

    if flow_run.id is None and not PREFECT_API_URL.value():
        return None
    payload = {
        "model_name": registered.name,
        "version": registered.version,
        "alias": registered.alias,
        "bits_per_byte": registered.bits_per_byte,
        "champion_bits_per_byte": registered.champion_bits_per_byte,
        "champion_version": registered.champion_version,
        "comparison": comparison,
    }
    try:
        return emit_event(
            event=PROMOTED if registered.promoted else REJECTED,
            resource={
                "prefect.resource.id": resource_id(registered.name, registered.version),
                "prefect.resource.name": f"{registered.name} v{registered.version}",
                "mlflow.model.name": registered.name,
                "mlflow.model.version": registered.version,
                "mlflow.model.alias": registered.alias,
            },
            related=[
                {"prefect.resource.id": f"mlflow.run.{registered.run_id}", "prefect.resource.role": "run"}
            ],
            payload=payload,
        )
    except Exception as exc:  # an event is a notification: never fail a registration over it
        logging.getLogger("llamaflow.register").warning(f"could not send the promotion event: {exc}")
        return None
