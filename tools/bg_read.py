#!/usr/bin/env python3
"""Read random 2.5 MiB blocks of FILE with O_DIRECT at about RATE MB/s for
SECONDS: disk traffic from another process, to see what reads alone cost a
decode running beside it (docs/benchmarks.md, "Filling the cache's free
room").

Usage: python3 tools/bg_read.py FILE RATE_MB_S SECONDS
"""

import mmap
import os
import random
import sys
import time


def main():
    path, rate_mb, secs = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    size = os.fstat(fd).st_size
    bs = 2560 * 1024
    buf = mmap.mmap(-1, bs)  # page-aligned, as O_DIRECT needs
    interval = bs / (rate_mb * 1e6)
    end = time.time() + secs
    n = 0
    while time.time() < end:
        t = time.time()
        off = random.randrange(0, size - bs) // 4096 * 4096
        os.preadv(fd, [buf], off)
        n += 1
        d = interval - (time.time() - t)
        if d > 0:
            time.sleep(d)
    print(f"bg_read: {n} reads of {bs} bytes, {n * bs / 1e6 / secs:.1f} MB/s", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
