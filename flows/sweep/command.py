"""A configuration's values as the `python -m flows.pretrain` command that gives it (what a sweep prints)."""

from __future__ import annotations

import json
import shlex
from typing import Any


def pretrain_command(values: dict[str, Any]) -> str:
    """`python -m flows.pretrain` with the flags that give the configuration of `values`."""
    words = ["python", "-m", "flows.pretrain"]
    if "preset" in values:  # first: the flags after it read as changes to it
        words += ["--preset", str(values["preset"])]
    for name, value in values.items():
        if name == "preset":
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + name.replace("_", "-"))
        elif value is None:
            words += [flag, "none"]
        elif isinstance(value, dict | list | tuple):
            words += [flag, json.dumps(value)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)
