"""The tiers workload of the harness (``python -m vmcache.bench --mode tiers``, where it is
documented): this script runs it with all its options (``--help``)."""

from vmcache.bench.tiers import main

if __name__ == "__main__":
    main()
