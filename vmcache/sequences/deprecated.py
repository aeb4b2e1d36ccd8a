"""The cache's old method names, kept one release as thin aliases of the facets' calls. Each
warns (``DeprecationWarning``, naming the new call) and forwards; ``tests/test_facets.py``
checks that every one warns and does what the new call does.

    old name                      new call
    assign / truncate / write_group       cache.beams.<same>
    swap_out / swap_in / swap_in_pages    cache.swap.out / restore / restore_pages
    manifest / wires / can_adopt / adopt_pages   cache.transfer.<same>
    adopt_sequence / export_sequence / import_sequence   cache.transfer.adopt / export / load
    trim / sleep / wake / reserve / headroom / peak_pages   cache.memory.<same>
    set_memory_limit                      cache.memory.set_limit
    asleep / resident_bytes / releases_memory (properties)   cache.memory.<..> / .releases
"""

from __future__ import annotations

import warnings

METHODS = {
    "assign": ("beams", "assign"),
    "truncate": ("beams", "truncate"),
    "write_group": ("beams", "write_group"),
    "swap_out": ("swap", "out"),
    "swap_in": ("swap", "restore"),
    "swap_in_pages": ("swap", "restore_pages"),
    "manifest": ("transfer", "manifest"),
    "wires": ("transfer", "wires"),
    "can_adopt": ("transfer", "can_adopt"),
    "adopt_pages": ("transfer", "adopt_pages"),
    "adopt_sequence": ("transfer", "adopt"),
    "export_sequence": ("transfer", "export"),
    "import_sequence": ("transfer", "load"),
    "trim": ("memory", "trim"),
    "set_memory_limit": ("memory", "set_limit"),
    "sleep": ("memory", "sleep"),
    "wake": ("memory", "wake"),
    "reserve": ("memory", "reserve"),
    "headroom": ("memory", "headroom"),
    "peak_pages": ("memory", "peak_pages"),
}
PROPERTIES = {
    "asleep": ("memory", "asleep"),
    "resident_bytes": ("memory", "resident_bytes"),
    "releases_memory": ("memory", "releases"),
}


def _warn(old: str, facet: str, new: str) -> None:
    warnings.warn(f"cache.{old} is deprecated: use cache.{facet}.{new}", DeprecationWarning,
                  stacklevel=3)  # fmt: skip


def _method(old: str, facet: str, new: str):
    def alias(self, *args, **kwargs):
        _warn(old, facet, new)
        return getattr(getattr(self, facet), new)(*args, **kwargs)

    alias.__name__, alias.__deprecated__ = old, f"cache.{facet}.{new}"
    alias.__doc__ = f"Deprecated: use ``cache.{facet}.{new}``."
    return alias


def _property(old: str, facet: str, new: str):
    def get(self):
        _warn(old, facet, new)
        return getattr(getattr(self, facet), new)

    prop = property(get, doc=f"Deprecated: use ``cache.{facet}.{new}``.")
    get.__deprecated__ = f"cache.{facet}.{new}"
    return prop


def install(cls) -> None:
    """Add every old name to ``cls`` (the coordinator) as a warning alias."""
    for old, (facet, new) in METHODS.items():
        setattr(cls, old, _method(old, facet, new))
    for old, (facet, new) in PROPERTIES.items():
        setattr(cls, old, _property(old, facet, new))


def is_deprecated(cls, name: str) -> bool:
    attr = getattr(cls, name, None)
    attr = attr.fget if isinstance(attr, property) else attr
    return hasattr(attr, "__deprecated__")
