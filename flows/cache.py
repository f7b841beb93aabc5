"""`python -m flows.cache`: show and prune what the data stages keep on disk under one budget: token cache
entries, packed datasets, tokenizers and the `datasets` library's cache (`tasks.data.cache_budget`).

    python -m flows.cache show                          # per kind, each dataset and tokenizer with its corpus
    python -m flows.cache prune --older-than 30         # items unused for 30 days
    python -m flows.cache prune --max-size 20G          # least recently used first, down to 20 GiB in all
    python -m flows.cache prune --max-size 5G --only tokens

Pruning waits for running data builds (they hold the token cache shared), never removes a dataset or
tokenizer being built, and always removes broken items (half a token entry, a directory without meta.json).
What it removes is built again when a run needs it. `cache_max_size` prunes the same way after each data stage.
"""

from __future__ import annotations

import argparse
import sys
import time

from tasks.data import cache_budget


def parse_size(text: str) -> int:
    try:
        return cache_budget.parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _days(item: cache_budget.Item, now: float) -> str:
    return f"{(now - item.last_used) / 86400:.1f} d"


def show(kinds: tuple[str, ...] = cache_budget.KINDS) -> str:
    found = cache_budget.items(kinds)
    now = time.time()
    lines = []
    for kind in kinds:
        mine = [i for i in found if i.kind == kind]
        broken = sum(i.broken for i in mine)
        head = f"{kind}: {len(mine)} entries, {human(sum(i.bytes for i in mine))}"
        if mine:
            head += f"; last used {_days(mine[-1], now)} to {_days(mine[0], now)} ago"
        lines.append(head + (f"; {broken} broken (pruned by any prune)" if broken else ""))
        if kind != "tokens":  # token entries are many: their total only
            for item in reversed(mine):
                flag = " BROKEN" if item.broken else ""
                lines.append(f"  {human(item.bytes):>10}  {_days(item, now):>8} ago  {item.label}{flag}")
    lines.append(f"total: {human(sum(i.bytes for i in found))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.cache", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("show", "sizes and last uses"),
        ("prune", "remove by age and/or down to a total size"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("--only", choices=cache_budget.KINDS, action="append", help="these kinds only")
    prune = commands.choices["prune"]
    prune.add_argument("--older-than", type=float, metavar="DAYS", help="remove items unused this long")
    prune.add_argument(
        "--max-size", type=parse_size, metavar="SIZE", help="then keep at most SIZE (e.g. 20G)"
    )
    args = parser.parse_args(argv)
    kinds = tuple(args.only or cache_budget.KINDS)
    if args.command == "prune":
        if args.older_than is None and args.max_size is None:
            parser.error("prune needs --older-than DAYS and/or --max-size SIZE")
        result = cache_budget.prune(
            older_than=None if args.older_than is None else args.older_than * 86400,
            max_bytes=args.max_size,
            kinds=kinds,
            on_wait=lambda: print("waiting for running data builds to finish", flush=True),
        )
        assert result is not None  # it waited
        removed, freed = result
        print(f"removed {len(removed)} entries, freed {human(freed)}")
    print(show(kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
