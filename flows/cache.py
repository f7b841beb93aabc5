"""`python -m flows.cache`: show and prune the token cache of this llamaflow home.

    python -m flows.cache show
    python -m flows.cache prune --older-than 30          # entries unused for 30 days
    python -m flows.cache prune --max-size 20G           # least recently used first, down to 20 GiB

Pruning waits for running data builds (they hold the cache shared) and never removes what one is reading;
what it removes is tokenized again when a run needs it.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

from tasks.data import token_store

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: write e.g. 500M, 20G or 1.5T (bytes: 1000)"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def show() -> str:
    entries = token_store.entries()
    where = token_store.tokens_dir()
    if not entries:
        return f"token cache {where}: empty"
    now = time.time()
    oldest, newest = (now - entries[0].last_used) / 86400, (now - entries[-1].last_used) / 86400
    return (
        f"token cache {where}: {len(entries)} entries, {_human(sum(e.bytes for e in entries))}; "
        f"last used {newest:.1f} to {oldest:.1f} days ago"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.cache", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("show", help="entries, size and ages of the token cache")
    prune = commands.add_parser("prune", help="remove entries by age and/or down to a total size")
    prune.add_argument("--older-than", type=float, metavar="DAYS", help="remove entries unused this long")
    prune.add_argument(
        "--max-size", type=parse_size, metavar="SIZE", help="then keep at most SIZE (e.g. 20G)"
    )
    args = parser.parse_args(argv)
    if args.command == "prune":
        if args.older_than is None and args.max_size is None:
            parser.error("prune needs --older-than DAYS and/or --max-size SIZE")
        removed, freed = token_store.prune(
            older_than=None if args.older_than is None else args.older_than * 86400,
            max_bytes=args.max_size,
            on_wait=lambda: print("waiting for running data builds to finish", flush=True),
        )
        print(f"removed {removed} entries, freed {_human(freed)}")
    print(show())
    return 0


if __name__ == "__main__":
    sys.exit(main())
