"""vLLM's KV tensor on a virtual-memory backend (CUDA VMM on a GPU): one reservation, physical
pages mapped under a group of blocks only while the scheduler wants it.

    worker     DeviceKVRegion: reserves the KV tensor's bytes, hands vLLM a tensor over the
               reservation, and before every model step (and every ``idle_s`` between steps)
               makes the mapped groups match the wanted ones: maps what is wanted, and unmaps
               what is not after waiting for the device (a step may still read it)
    scheduler  WantedGroups: one byte a group in a memfd the worker publishes (the rendezvous
               of :mod:`vmcache.vllm.region`); sets a group's byte before it lets the group's
               blocks out to vLLM and clears it after taking them back

Unlike the host's memfd, device memory cannot be punched from another process, so the worker
maps and unmaps; the scheduler only says what it wants. Group 0 (vLLM's null block) is always
mapped. Every call follows the CUDA driver's page rules; :class:`StrictBackend` checks them
on the CPU.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from pathlib import Path

import torch

from vmcache.memory.backends.base import Backend, round_up
from vmcache.vllm.region import BlockLayout, open_peer_fd, publish_rendezvous


class DeviceKVRegion:
    def __init__(self, backend: Backend, nbytes: int) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        self.backend, self.page_bytes = backend, backend.granularity
        self.nbytes = round_up(nbytes, self.page_bytes)
        self.base = backend.reserve(self.nbytes)
        self.layout: BlockLayout | None = None
        self.mapped: dict[int, list] = {}  # group -> its page handles, segment by segment
        self.wants_fd = -1
        self._wants: mmap.mmap | None = None
        self.lock = threading.RLock()  # sync() against the model's step (step() holds it)

    def tensor(self, nbytes: int, dtype: torch.dtype = torch.int8) -> torch.Tensor:
        if nbytes > self.nbytes:
            raise ValueError(f"{nbytes} bytes asked of a {self.nbytes}-byte region")
        return self.backend.view(self.base, nbytes).view(dtype)

    def bind(self, layout: BlockLayout) -> None:
        """Take vLLM's layout (after it built its views), make the wanted-groups memfd and map
        group 0."""
        if layout.page_bytes != self.page_bytes or layout.extent > self.nbytes:
            raise ValueError("the layout does not fit this region")
        self.layout = layout
        self.wants_fd = os.memfd_create("vmcache-vllm-wants", os.MFD_CLOEXEC)
        os.ftruncate(self.wants_fd, layout.num_groups)
        self._wants = mmap.mmap(self.wants_fd, layout.num_groups, mmap.MAP_SHARED)
        self._wants[0] = 1
        self.sync()

    def publish(self, path: Path) -> None:
        publish_rendezvous(path, "groups", self.wants_fd, self.layout.num_groups, self.layout)

    def _ranges(self, g: int) -> list[tuple[int, int]]:
        return self.layout.ranges([g])

    @contextlib.contextmanager
    def step(self):
        """Around a model step (vLLM's ``execute_model`` and ``sample_tokens``): the wanted
        groups mapped first, and no group unmapped until the step returns (a sync from
        another thread, the idle one, waits for it), as vLLM's own frees wait for the step
        that may read them."""
        with self.lock:
            self.sync()
            yield

    def sync(self) -> tuple[int, int]:
        """Map the wanted groups not mapped, unmap the mapped ones not wanted (after the
        device is idle). Returns (mapped, unmapped) group counts."""
        with self.lock:
            wants = self._wants
            drop = [g for g in self.mapped if not wants[g]]
            add = [g for g in range(self.layout.num_groups) if wants[g] and g not in self.mapped]
            if drop:
                self.backend.synchronize()
                for g in drop:
                    self._unmap(g)
            for g in add:
                self._map(g)
            return len(add), len(drop)

    def _map(self, g: int) -> None:
        handles: list = []
        done: list[tuple[int, int]] = []
        try:
            for off, length in self._ranges(g):
                pages = [self.backend.create_page(self.page_bytes)
                         for _ in range(length // self.page_bytes)]  # fmt: skip
                handles += pages
                self.backend.map(self.base + off, pages, self.page_bytes)
                done.append((off, length))
        except BaseException:
            for off, length in done:
                self.backend.unmap(self.base + off, length // self.page_bytes, self.page_bytes)
            for h in handles:
                self.backend.release_page(h)
            raise
        self.mapped[g] = handles

    def _unmap(self, g: int) -> None:
        for off, length in self._ranges(g):
            self.backend.unmap(self.base + off, length // self.page_bytes, self.page_bytes)
        for h in self.mapped.pop(g):
            self.backend.release_page(h)

    def resident_bytes(self) -> int:
        return sum(len(h) for h in self.mapped.values()) * self.page_bytes

    def close(self) -> None:
        with self.lock:
            if self.mapped:
                self.backend.synchronize()
            for g in list(self.mapped):
                self._unmap(g)
            if self._wants is not None:
                self._wants.close()
                os.close(self.wants_fd)
                self._wants = None
            if self.base:
                self.backend.release_reservation(self.base, self.nbytes)
                self.base = 0


class WantedGroups:
    """The scheduler's side: which groups the worker keeps mapped (one byte a group)."""

    def __init__(self, body: dict, layout: BlockLayout) -> None:
        self.layout = layout
        self.fd = open_peer_fd(body)
        self._map = mmap.mmap(self.fd, layout.num_groups, mmap.MAP_SHARED)

    def back(self, groups: list[int]) -> None:
        for g in groups:
            self._map[g] = 1

    def unback(self, groups: list[int]) -> None:
        for g in groups:
            self._map[g] = 0

    punch = None  # a group's pages go back whole, by the worker

    def close(self) -> None:
        if self.fd >= 0:
            self._map.close()
            os.close(self.fd)
            self.fd = -1
