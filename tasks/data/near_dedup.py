"""Near-duplicate whole files, dropped with MinHash LSH (`datasketch`; `dedup="minhash"`).

Each whole file's text is shingled into word 5-grams and summarized by a MinHash of `NUM_PERM` permutations
(a fixed seed: the same corpus drops the same files in every run); an LSH index at the Jaccard threshold
finds the files like one already kept. Validation files are indexed first, so a training file close to
validation text is the one dropped; a near copy on the same side keeps the first in corpus order.
"""

from __future__ import annotations

from functools import cache

from tasks.data.errors import DataError
from tasks.data.files import SourceFile
from tasks.data.split import WholeSplit

NUM_PERM = 128
SHINGLE_WORDS = 5
SEED = 1


def _minhash(path: str):  # -> datasketch.MinHash
    from datasketch import MinHash

    with open(path, encoding="utf-8") as handle:
        words = handle.read().split()
    shingles = {" ".join(words[i : i + SHINGLE_WORDS]) for i in range(max(1, len(words) - SHINGLE_WORDS + 1))}
    minhash = MinHash(num_perm=NUM_PERM, seed=SEED)
    minhash.update_batch([s.encode("utf-8") for s in shingles])
    return minhash


@cache
def _near_copies(files: tuple[SourceFile, ...], threshold: float) -> frozenset[str]:
    """The paths of the files (validation first, then corpus order) like one before them."""
    try:
        from datasketch import MinHashLSH
    except ImportError as err:
        raise DataError("dedup='minhash' needs datasketch: pip install 'llamaflow[dedup]'") from err
    index = MinHashLSH(threshold=threshold, num_perm=NUM_PERM)
    dropped = set()
    for number, file in enumerate(files):
        minhash = _minhash(file.path)
        if index.query(minhash):
            dropped.add(file.path)
        else:
            index.insert(str(number), minhash)
    return frozenset(dropped)


def drop_near_copies(placed: WholeSplit, threshold: float) -> WholeSplit:
    """`placed` without the files near a kept one (counted among its duplicates). A validation file near
    another is dropped only while one stays on validation."""
    files = tuple(f for f in placed.validation + placed.train if f.size)
    dropped = _near_copies(files, threshold)
    validation = [f for f in placed.validation if f.path not in dropped] or placed.validation[:1]
    train = [f for f in placed.train if f.path not in dropped]
    gone = [f for f in placed.validation + placed.train if f not in validation and f not in train]
    return WholeSplit(validation, train, placed.duplicates + gone, placed.record, placed.carried)
