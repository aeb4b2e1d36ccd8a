"""The elastic workload of the harness (``python -m vmcache.bench --mode elastic``, where it is
documented): this script runs it with all its options (``--help``)."""

from vmcache.bench.elastic import main

if __name__ == "__main__":
    main()
