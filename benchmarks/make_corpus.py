"""A large text corpus made on this machine, for the data benchmarks (issue 40): the source and documentation
files installed here (Python, C headers, Markdown, reStructuredText, plain text) as JSONL shards of
`{"text": ..., "path": ...}` records, one per file, duplicates (by content) and non-UTF-8 files left out.

    .venv/bin/python benchmarks/make_corpus.py OUT_DIR --bytes 1073741824 [--shard-bytes 64000000]

Deterministic for a given machine: the files are taken in sorted path order until `--bytes` of text.
Never written into the repository (give a temporary directory).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

SUFFIXES = (".py", ".pyi", ".h", ".c", ".md", ".rst", ".txt")
ROOTS = ("/usr", "/opt", "/work/main/.venv", "/root")
SKIP = ("/proc", "/sys", "/tmp", "/work/wt")


def _files() -> Iterator[Path]:
    for root in ROOTS:
        for directory, dirs, names in os.walk(root, followlinks=False):
            dirs.sort()
            if directory.startswith(SKIP):
                dirs.clear()
                continue
            for name in sorted(names):
                if name.endswith(SUFFIXES):
                    path = Path(directory) / name
                    if path.is_file() and not path.is_symlink():
                        yield path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--shard-bytes", type=int, default=64_000_000)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    seen: set[bytes] = set()
    total = shard_bytes = shard = records = 0
    out = (args.out / f"part-{shard:05d}.jsonl").open("w", encoding="utf-8")
    for path in _files():
        try:
            raw = path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        digest = hashlib.blake2b(raw, digest_size=16).digest()
        if not text.strip() or digest in seen:
            continue
        seen.add(digest)
        if shard_bytes >= args.shard_bytes:
            out.close()
            shard, shard_bytes = shard + 1, 0
            out = (args.out / f"part-{shard:05d}.jsonl").open("w", encoding="utf-8")
        out.write(json.dumps({"text": text, "path": str(path)}) + "\n")
        shard_bytes += len(raw)
        total += len(raw)
        records += 1
        if total >= args.bytes:
            break
    out.close()
    print(json.dumps({"out": str(args.out), "text_bytes": total, "records": records, "shards": shard + 1}))
    if total < args.bytes:
        raise SystemExit(f"only {total:,} bytes of text found, fewer than --bytes={args.bytes:,}")


if __name__ == "__main__":
    main()
