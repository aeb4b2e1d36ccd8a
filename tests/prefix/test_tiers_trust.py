"""The disk tier as an attacker or a failing disk meets it: planted files are never served,
digests confirm no guessed prompt, files and directory are private, a full disk loses no page,
a FIFO or symlink named like a tier file is never opened, and one directory has one user."""

import hashlib
import os
import resource
import signal
import stat
import subprocess
import sys
import textwrap

import pytest
import torch
from prefix_machine import append, tpp
from tier_cases import cache, cached, hit, kvt

from vmcache import CacheFull
from vmcache.prefix.tiers import PrefixTiers
from vmcache.prefix.tiers.digest import (
    DIGEST_BYTES,
    mac,
    page_digest,
    root_digest,
    salt_bytes,
)
from vmcache.prefix.tiers.disk import _HEAD, _ROW
from vmcache.prefix.tiers.files import TierDirectoryError
from vmcache.sequences.invariants import check_invariants


@pytest.fixture
def tmp(tmp_path):
    return tmp_path / "tier"


def forge(path, value, key):
    """Rewrite tier file ``path`` as an attacker who can read and write the directory would:
    same header, digests and root tag, every entry's bytes set to ``value``, the table and
    entry tags recomputed with ``key`` (the attacker's guess: not the cache's secret)."""
    raw = bytearray(path.read_bytes())
    magic, version, n, eb, tag, _ = _HEAD.unpack_from(raw)
    data0 = _HEAD.size + n * _ROW
    fake = torch.full((eb // 4,), float(value)).view(torch.uint8).numpy().tobytes()
    table = b""
    for i in range(n):
        d = bytes(raw[_HEAD.size + i * _ROW : _HEAD.size + i * _ROW + DIGEST_BYTES])
        raw[data0 + i * eb : data0 + (i + 1) * eb] = fake
        table += d + mac(key, d, fake)
    head = _HEAD.pack(magic, version, n, eb, tag, bytes(16))
    head = head[:-DIGEST_BYTES] + mac(key, head[:-DIGEST_BYTES], table)
    path.write_bytes(head + table + bytes(raw[data0:]))


@pytest.mark.parametrize("kind", ["vm", "paged"])
@pytest.mark.parametrize("given_key", [None, b"k" * 32])
def test_a_forged_file_is_never_served(kind, given_key, tmp):
    c = cache(kind, PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22, key=given_key))
    P = tpp(c)
    A = [1] * P + [2] * P
    cached(c, A)
    (path,) = kvt(tmp)
    for guess in (b"", b"k" * 31 + b"x", bytes(32)):  # no key, a near key, zeros
        forge(path, 7.0, hashlib.blake2b(guess, digest_size=32).digest())
        assert hit(c, A) == 0  # hit() checks K/V: 7.0 would fail it; a miss is served
        assert c.prefix.tier_stats().corrupt_files >= 1 and not path.exists()
        cached(c, A)
        (path,) = kvt(tmp)
    assert hit(c, A) == 2 * P  # the cache's own file is served
    c.close()


def test_stored_digests_confirm_no_guessed_prompt(tmp):
    """Who reads a tier file and guesses the prompt cannot check the guess: digests are
    keyed (the old, unkeyed chain over the same layout and tokens is not in the file)."""
    c = cache("vm", PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22))
    P = tpp(c)
    A = [5] * P
    cached(c, A)
    raw = kvt(tmp)[0].read_bytes()
    stored = raw[_HEAD.size : _HEAD.size + DIGEST_BYTES]
    assert stored == page_digest(c.prefix.index.root, salt_bytes(None), A)  # the cache's chain
    for key in (b"", bytes(32)):
        guess = root_digest({"cache": "VMKVCache", "namespace": ""}, key)
        assert page_digest(guess, salt_bytes(None), A) not in raw
    assert c.prefix.index.root not in raw  # the root is never stored (a one-way tag is)
    c.close()


def test_directory_files_and_key_are_private(tmp):
    c = cache("vm", PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22))
    cached(c, [1] * tpp(c))
    assert stat.S_IMODE(os.stat(tmp).st_mode) == 0o700
    for name in [p.name for p in kvt(tmp)] + [".key", ".lock"]:
        assert stat.S_IMODE(os.stat(tmp / name).st_mode) == 0o600, name
    assert os.stat(tmp / ".key").st_size == 32
    c.close()


def test_a_directory_others_can_write_needs_a_key(tmp):
    tmp.mkdir(mode=0o777)
    os.chmod(tmp, 0o777)  # umask aside
    with pytest.raises(TierDirectoryError, match="key"):
        cache("vm", PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22))
    assert not (tmp / ".key").exists()
    c = cache("vm", PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22, key=b"s" * 16))
    cached(c, [1] * tpp(c))
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in kvt(tmp))
    c.close()


def test_a_key_file_that_is_not_private_is_refused(tmp):
    tmp.mkdir(mode=0o700)
    (tmp / ".key").write_bytes(bytes(32))
    os.chmod(tmp / ".key", 0o644)
    with pytest.raises(TierDirectoryError, match="private"):
        cache("vm", PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22))
    os.unlink(tmp / ".key")
    os.symlink("/etc/hostname", tmp / ".key")
    with pytest.raises(TierDirectoryError):
        cache("vm", PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22))


def test_bad_keys(tmp):
    with pytest.raises(TypeError):
        PrefixTiers(10, key="a string")
    with pytest.raises(ValueError, match="16 to 64"):
        PrefixTiers(10, key=b"short")


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_a_full_disk_loses_no_page(kind, tmp):
    """A demotion the disk refuses (here RLIMIT_FSIZE: EFBIG, as a full disk or a quota
    gives ENOSPC / EDQUOT) drops its entries and frees their pages; no temporary file stays,
    the grow that evicted them succeeds or raises only CacheFull, invariants hold."""
    c = cache(kind, PrefixTiers(disk_dir=tmp, disk_bytes=1 << 24), pages=16, max_seq_len=4096)
    P = tpp(c)
    prompts = [[i] * P for i in range(1, 4)]
    for p in prompts:
        s = c.new_sequence(prefix_tokens=p)
        append(c, s, p)
        c.free(s)
    assert c.prefix.index.stats().cached_pages > 0
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))  # no tier file fits
    try:
        hog = c.new_sequence()
        every = (c._pool.num_pages // c.capacity.pages_for_tokens(P)) * P
        with pytest.raises(CacheFull):  # more than the pool: only CacheFull
            c.grow(hog, every + P)
        c.grow(hog, every)  # every page: the evicted ones too (their demotion failed)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    st_ = c.prefix.tier_stats()
    assert st_.failed_disk_writes >= 1 and st_.dropped_pages > 0
    assert c.prefix.index.stats().cached_pages == 0 and c._pool.num_free == 0
    assert not list(tmp.glob("*.tmp")) and not kvt(tmp)
    check_invariants(c)
    c.free(hog)
    assert [hit(c, p) for p in prompts] == [0, 0, 0]  # a miss, never a wrong page
    cached(c, prompts[0])  # the disk works again
    assert hit(c, prompts[0]) == P
    c.close()


def _with_deadline(seconds):
    def on_alarm(*_):
        raise TimeoutError("blocked on a FIFO")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)


def test_a_fifo_or_symlink_named_like_a_tier_file_is_never_opened(tmp):
    tmp.mkdir(mode=0o700)
    os.mkfifo(tmp / ("f" * 32 + ".kvt"))
    os.symlink("/etc/hostname", tmp / ("s" * 32 + ".kvt"))
    _with_deadline(20)
    try:
        c = cache("vm", PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22))  # the scan
        assert c.prefix.tier_stats().skipped_files == 2
        P = tpp(c)
        cached(c, [4] * P)
        (path,) = c.prefix.index.tiers.disk.files()
        os.unlink(path)
        os.mkfifo(path)  # swapped for a FIFO after it was indexed: a hit must not block
        assert hit(c, [4] * P) == 0
        assert c.prefix.tier_stats().corrupt_files == 1
    finally:
        signal.alarm(0)
    assert stat.S_ISFIFO(os.lstat(tmp / ("f" * 32 + ".kvt")).st_mode)  # not ours: left
    c.close()


def test_stale_temporaries_are_removed_at_open(tmp):
    c = cache("vm", PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22))
    c.close()
    (tmp / "abc.kvt.tmp").write_bytes(b"half a file")
    c = cache("vm", PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22))
    assert not (tmp / "abc.kvt.tmp").exists()
    c.close()


def test_one_directory_serves_one_tiers_at_a_time(tmp):
    c = cache("vm", PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22))
    with pytest.raises(TierDirectoryError, match="in use"):
        cache("paged", PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22))
    code = textwrap.dedent(f"""
        from vmcache.prefix.tiers import PrefixTiers
        from vmcache.prefix.tiers.files import TierDirectoryError
        t = PrefixTiers(disk_dir={str(tmp)!r}, disk_bytes=1 << 20)
        try:
            t.bind({{"cache": "x"}}, 64)
        except TierDirectoryError:
            print("refused")
        """)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.stdout.strip() == "refused", out.stderr
    c.close()
    other = cache("paged", PrefixTiers(disk_dir=tmp, disk_bytes=1 << 22))  # after close: ok
    other.close()
