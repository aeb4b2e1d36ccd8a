"""Where the repository's own files are, for the tests that read or run them (the README,
the docs, the benchmarks, the examples, the package's sources)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository: tests/ is one level down
