"""The main job (`make bench`): the A/B benchmarks on a small default workload, as tables.

python benchmarks/run.py [--device cpu|cuda] [--full]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_attention  # noqa: E402
import bench_vmm  # noqa: E402
import torch  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--full", action="store_true", help="the full grids instead of the quick ones")
    args = ap.parse_args(argv)
    common = ["--device", args.device] + ([] if args.full else ["--quick"])
    print("== decode A/B: contiguous (vmcache) vs ordinary tensor vs paged ==")
    bench_attention.main(common)
    print("\n== virtual-memory operations ==")
    bench_vmm.main(common)


if __name__ == "__main__":
    main()
