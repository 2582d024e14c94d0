"""The disk a command takes at its peak: the filesystem's used bytes sampled while it runs (CI ran out of disk once).

    python benchmarks/disk_peak.py -- bash .ci/run                 # a whole CI run, from a fresh clone
    python benchmarks/disk_peak.py --folder /tmp/pytest-of-$USER -- python -m pytest -q   # the suite's temporaries

Prints the command's exit status, its wall time, the peak growth of the used bytes of the filesystem holding the
current folder over the start, and (with --folder) the peak size of that folder. Other writers on the same disk count
too: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path


def folder_bytes(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
        except OSError:  # removed while we looked
            pass
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--folder", type=Path, help="also sample this folder's size")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    base = shutil.disk_usage(".").used
    peak_disk, peak_folder = 0, 0
    start = time.perf_counter()
    process = subprocess.Popen(command)
    while process.poll() is None:
        peak_disk = max(peak_disk, shutil.disk_usage(".").used - base)
        if args.folder is not None and args.folder.exists():
            peak_folder = max(peak_folder, folder_bytes(args.folder))
        time.sleep(args.every)
    wall = time.perf_counter() - start
    print(f"exit {process.returncode}, {wall / 60:.1f} min; the disk's used bytes grew by up to {peak_disk / 1e9:.2f} GB", file=sys.stderr)
    if args.folder is not None:
        print(f"{args.folder} peaked at {peak_folder / 1e9:.2f} GB", file=sys.stderr)
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
