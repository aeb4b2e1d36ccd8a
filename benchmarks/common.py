"""The benchmarks' shared timer, results writer and table: one copy, in the package."""

from vmcache.bench.common import (
    RESULTS,
    add_out_arg,
    device_name,
    parse_args,
    save,
    save_and_plot,
    table,
    time_fn,
    time_repeats,
)

__all__ = [
    "RESULTS",
    "add_out_arg",
    "device_name",
    "parse_args",
    "save",
    "save_and_plot",
    "table",
    "time_fn",
    "time_repeats",
]
