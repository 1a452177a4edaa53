"""A box's disk in a rehearsal: which block devices its files are on, and a cold page cache.

The io controller limits block devices, by their "MAJ:MIN", and only whole disks: the
kernel refuses a partition's numbers, so a file on /dev/sda2 is limited through /dev/sda.
A file on no block device (tmpfs, overlayfs, a btrfs subvolume's anonymous device) cannot
be limited at all, and the rehearsal says so rather than run its box at the machine's
speed unannounced.

The boxes read their stage files cold: before the agents start, the model's files are
dropped from the page cache with posix_fadvise(POSIX_FADV_DONTNEED), file by file. Not
`echo 3 > /proc/sys/vm/drop_caches`, which empties the whole machine's cache (every other
program on it pays to read its files again, and its timings move) and its dentries and
inodes with it, for files no box reads. The model's files are the only ones a box reads
that could be cached: its stage files are cut fresh into the rehearsal's own directory.
DONTNEED drops clean pages that no process maps; the rehearsal has started nothing yet.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from edgebus.rehearse.cgroups import CgroupError

SYS_DEV_BLOCK = Path("/sys/dev/block")


def block_device(path: Path) -> str:
    """The whole disk `path` is on, as "MAJ:MIN"."""
    dev = path.stat().st_dev
    number = f"{os.major(dev)}:{os.minor(dev)}"
    entry = SYS_DEV_BLOCK / number
    if not entry.exists():
        raise CgroupError(f"{path} is on no block device (device {number}: a tmpfs, an "
                          "overlay or a btrfs subvolume?), so the io controller cannot hold a "
                          "box's disk: to its rates — put the model and the rehearsal's "
                          "directory ($TMPDIR) on a disk, or leave the boxes' disk: out")
    if (entry / "partition").exists():
        # /sys/dev/block/8:2 links to .../block/sda/sda2: the disk is the directory above.
        return (entry.resolve().parent / "dev").read_text().strip()
    return number


def devices(paths: Iterable[Path]) -> list[str]:
    """The disks `paths` are on, each once, in the order first met."""
    return list(dict.fromkeys(block_device(path) for path in paths))


def files(path: Path) -> list[Path]:
    """`path` if it is a file, else the files under it."""
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def drop_from_cache(paths: Iterable[Path]) -> None:
    """Drop the files at `paths` (files, or directories of them) from the page cache."""
    for path in paths:
        for file in files(path):
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)  # a file just written (a bench's model) has dirty pages DONTNEED keeps
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
