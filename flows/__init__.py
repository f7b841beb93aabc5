"""Flows compose the tasks; importing `tasks` first applies the embedded defaults before Prefect loads."""

import tasks  # noqa: F401
