"""The options that make `uv pip install` install what `pip install` would on this host: uv reads none of
pip's configuration (pip.conf files, PIP_* variables), so its sources and constraints are passed on as options,
and `--index-strategy unsafe-best-match` gives pip's choice among several indexes (the best version from any,
not the first index that has the name). Standard library only: it runs before anything is installed.

    python .ci/uv_options.py     # prints the options, one a line (the Makefile reads them)
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Mapping

# pip's option -> uv's, for the ones that decide what gets installed. Each value may list several, whitespace
# separated, as in pip.conf.
OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
FLAGS = {"no-index": "--no-index"}
# Later sections win: pip's `install` section over `global`, its PIP_* variables over every file.
SECTIONS = ("global", "install", ":env:")


def uv_options(env: Mapping[str, str] | None = None) -> list[str]:
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True, text=True, check=True, env=None if env is None else dict(env),
    ).stdout  # fmt: skip
    values: dict[str, tuple[int, str]] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if section in SECTIONS and (name in OPTIONS or name in FLAGS):
            rank = SECTIONS.index(section)
            if rank >= values.get(name, (-1, ""))[0]:
                values[name] = (rank, shlex.split(value)[0] if value else "")
    options = ["--index-strategy", "unsafe-best-match"]
    for name, (_, value) in sorted(values.items()):
        if name in FLAGS:
            options += [FLAGS[name]] if value.lower() in ("1", "true", "yes", "on") else []
        else:
            options += [part for item in value.split() for part in (OPTIONS[name], item)]
    return options


if __name__ == "__main__":
    print("\n".join(uv_options()))
