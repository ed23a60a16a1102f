"""Run a command and report the peak resident memory of its whole process tree (Linux /proc).

    python recipes/train/peak_memory.py hf-posenc train ...

Samples every 0.2 s and prints peak RSS, its anonymous part (heap: what the program holds) and
its file-backed part (pages of memory-mapped files, e.g. Arrow caches, that the kernel can drop
under memory pressure). Sums over processes count pages shared by forked workers once per process.
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

FIELDS = ("VmRSS", "RssAnon", "RssFile")


def _status(pid: int) -> dict[str, int]:
    values = {}
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                if key in FIELDS:
                    values[key] = int(rest.split()[0])  # kB
    except OSError:
        pass
    return values


def main(command: list[str]) -> int:
    start = time.monotonic()
    child = subprocess.Popen(command)
    peak = dict.fromkeys(FIELDS, 0)
    while child.poll() is None:
        try:
            tree = [child.pid, *(p.pid for p in psutil.Process(child.pid).children(recursive=True))]
        except psutil.NoSuchProcess:
            break
        total = dict.fromkeys(FIELDS, 0)
        for pid in tree:
            for key, value in _status(pid).items():
                total[key] += value
        peak = {key: max(peak[key], total[key]) for key in FIELDS}
        time.sleep(0.2)
    gib = {key: value / 2**20 for key, value in peak.items()}
    print(
        f"exit={child.returncode} wall={time.monotonic() - start:.0f}s peak_rss={gib['VmRSS']:.2f}GiB "
        f"peak_anon={gib['RssAnon']:.2f}GiB peak_file={gib['RssFile']:.2f}GiB",
        flush=True,
    )
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
