"""The shared-budget ledger (vmcache/memory/ledger.py) under faults: bad requests, two budgets
in one process, a crash in the middle of an update, a process stopped holding the lock, a hung
holder whose lease runs out, a ledger deleted or damaged while in use."""

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from vmcache.memory.ledger import LedgerError, SharedBudget


@pytest.fixture
def path(tmp_path):
    return tmp_path / "budget.db"


def held(b):
    return {h: r["held"] for h, r in b.snapshot()["holders"].items()}


def test_bad_requests_are_value_errors_and_change_nothing(path):
    b = SharedBudget(path, 10)
    assert b.acquire(3)
    for bad in (-5, 1.5, True, "2", None):
        with pytest.raises(ValueError):
            b.acquire(bad)
        with pytest.raises(ValueError):
            b.release(bad)
    with pytest.raises(ValueError):
        b.release(4)  # more than held
    assert b.held == 3 and held(b) == {b.id: 3}
    for kw in ({"lock_timeout_s": 0}, {"lease_s": -1}, {"min_pages": -1}, {"max_pages": 2.5}):
        with pytest.raises(ValueError):
            SharedBudget(path, **kw)
    assert held(b) == {b.id: 3}
    b.close()


def test_the_ledger_file_is_private(path):
    SharedBudget(path, 10).close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_two_budgets_in_one_process_are_two_holders(path):
    a, b = SharedBudget(path, 10), SharedBudget(path)
    assert a.acquire(6) and not b.acquire(5) and b.acquire(4)
    assert held(a) == {a.id: 6, b.id: 4}  # one row each, not one per pid
    a.release(6)
    assert held(b) == {a.id: 0, b.id: 4}
    a.close()
    assert held(b) == {b.id: 4} and b.acquire(6)
    b.close()


def _child(path, body: str, kw: str = "") -> subprocess.Popen:
    """A process with its own SharedBudget(path, kw) running ``body`` (prints 'ready')."""
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        from vmcache.memory.ledger import SharedBudget
        b = SharedBudget(sys.argv[1], {kw})
        """) + textwrap.dedent(body)  # fmt: skip
    p = subprocess.Popen(
        [sys.executable, "-c", code, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "ready"
    return p


def test_a_crash_in_the_middle_of_an_update_leaves_the_ledger_as_it_was(path):
    """The old ledger truncated then wrote the file: a crash between left it empty or cut,
    and every process failed for good. An update is a transaction now."""
    mine = SharedBudget(path, 10)
    assert mine.acquire(2)
    p = _child(path, """
        assert b.acquire(3)
        b._file.db.execute("BEGIN IMMEDIATE")
        b._file.db.execute("UPDATE holders SET held = 99")
        b._file.db.execute("DELETE FROM meta")
        print("ready", flush=True)
        os._exit(9)  # dies mid-transaction
        """)  # fmt: skip
    p.wait(timeout=60)
    assert held(mine) == {mine.id: 2}  # the dead child's row reaped, nothing else touched
    assert mine.snapshot()["total_pages"] == 10 and mine.acquire(8)
    mine.close()


def test_a_process_stopped_inside_a_transaction_holds_the_others_only_for_the_bound(path):
    """It used to hold every other holder's calls for good (each got LedgerError after the
    timeout, again and again): now the first to wait past the bound removes the stuck file
    and every holder goes on in a new one; the stopped one rejoins when it resumes."""
    mine = SharedBudget(path, 10, lock_timeout_s=0.5, rejoin_grace_s=0.5)
    assert mine.acquire(1)
    p = _child(path, """
        assert b.acquire(3)
        b._file.db.execute("BEGIN IMMEDIATE")
        b._file.db.execute("UPDATE holders SET held = 99")  # its rollback journal is hot now
        print("ready", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        b._file.db.execute("ROLLBACK")
        print(b.available(), b.rejoined, flush=True)
        """, "lock_timeout_s=0.5")  # fmt: skip
    try:
        t0 = time.monotonic()
        assert not mine.acquire(2)  # waited the bound, then went on in a new file, where
        assert time.monotonic() - t0 < 5 and mine.rebuilt == 1 and mine.held == 1
        time.sleep(0.6)  # nobody grows until the live holders had time to register
        assert mine.acquire(2) and mine.held == 3
        assert "lock" in mine.fault and str(path) in mine.fault
        assert held(mine) == {mine.id: 3}  # the stopped holder is not there until it resumes
        assert not [f for f in os.listdir(path.parent) if ".stuck-" in f]  # nothing left
        assert mine.acquire(1) and mine.release(1) is None  # the new file is whole
        assert held(mine) == {mine.id: 3}  # (the old journal played into it would not be)
        p.send_signal(signal.SIGCONT)
        room, rejoined = p.stdout.readline().split()
        assert rejoined == "1" and held(mine) == {mine.id: 3, **{k: 3 for k in held(mine)
                                                               if k != mine.id}}  # fmt: skip
    finally:
        p.kill()
        p.wait(timeout=60)
    assert held(mine) == {mine.id: 3}  # killed now: reaped
    mine.close()


def test_a_stopped_holder_with_a_lease_is_reaped_and_rejoins_within_the_total(path):
    """A serving process keeps its lease from a thread of its own: idle, it stays; stopped
    (SIGSTOP), it loses its pages within the lease; resumed, it registers again capped at
    what the others left, marked to shed the rest. (Servers took no lease: a stopped one
    held its pages for good.)"""
    other = SharedBudget(path, 10)
    p = _child(path, """
        assert b.acquire(6)
        print("ready", flush=True)
        while True:
            line = sys.stdin.readline()
            print(b.held, b.max, b.shed, b.excess(), b.rejoined, flush=True)
        """, "lease_s=0.4, keepalive=True")  # fmt: skip
    try:
        time.sleep(1.2)  # idle three leases: its thread beats
        assert sorted(held(other).values()) == [0, 6]
        p.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while len(held(other)) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held(other) == {other.id: 0} and other.acquire(8)
        p.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while len(held(other)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        rows = other.snapshot()["holders"]
        child = next(r for h, r in rows.items() if h != other.id)
        assert child["held"] == 6 and child["max"] == 2  # what fits beside the 8
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().split() == ["6", "2", "True", "4", "1"]
        assert not other.acquire(1)  # nobody takes more until the total is kept again
    finally:
        p.kill()
        p.wait(timeout=60)
    other.close()


def test_a_hung_holder_loses_its_pages_when_its_lease_runs_out_and_rejoins_if_it_resumes(path):
    hung = SharedBudget(path, 10, lease_s=0.3)
    other = SharedBudget(path)
    assert hung.acquire(8) and not other.acquire(5)
    time.sleep(0.5)  # no sign of life from `hung` for longer than its lease
    assert other.acquire(5) and hung.id not in held(other)
    p = _child(path, """
        print("ready", flush=True)
        while True: time.sleep(0.05); b.beat()
        """, "lease_s=0.3")  # fmt: skip
    try:
        time.sleep(0.8)
        assert len(held(other)) == 2  # a holder that beats within its lease stays
    finally:
        p.kill()
        p.wait(timeout=60)
    assert hung.available() == 0  # it resumes: joins again with the 8 it still has
    assert hung.rejoined == 1 and held(other) == {hung.id: 8, other.id: 5}  # over: shown
    assert not other.acquire(1)  # nobody gets more until the total is kept again
    other.release(5)
    hung.release(8)
    assert other.acquire(10)
    hung.close()
    other.close()


def test_a_deleted_ledger_is_rebuilt_from_what_live_holders_hold_within_the_total(path):
    """Rejoining inserted what a holder held without a room check (14 pages held of 10, and
    nothing asked of the holder): now it is capped at what fits and sheds to it, and gets
    its own limit back once it fits."""
    a = SharedBudget(path, 10)
    assert a.acquire(10)
    os.unlink(path)
    newcomer = SharedBudget(path, 10)  # a fresh ledger at the same path
    assert newcomer.acquire(4)  # it cannot know of `a` until `a` says so (docs/security.md)
    assert not a.acquire(1)  # a's next call re-registers its 10 in the new file
    assert a.rejoined == 1 and held(newcomer) == {a.id: 10, newcomer.id: 4}
    assert a.max == 6 and a.shed and a.excess() == 4  # what fits: its owner sheds 4
    assert not newcomer.acquire(1)
    a.release(4)
    assert a.available() == 0 and a.max == 10 and not a.shed  # fits: its own limit back
    assert sum(held(a).values()) == 10
    newcomer.close()
    assert a.acquire(4) and held(a) == {a.id: 10}
    a.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "json", "header"])
def test_a_damaged_ledger_is_rebuilt_from_the_live_holders_accounts(path, damage):
    """Damage used to fail every call of every holder for good: now the first holder that
    finds it moves the file aside (kept) and every live holder registers what it holds in a
    new file; a newcomer is refused naming the command that recovers it."""
    a = SharedBudget(path, 10, name="a", rejoin_grace_s=0.5)
    b = SharedBudget(path, name="b", rejoin_grace_s=0.5)
    assert a.acquire(2) and b.acquire(3)
    raw = path.read_bytes()
    new = {"garbage": os.urandom(len(raw)), "truncated": raw[:100],
           "json": b'{"total_pages": 10, "procs": {}}',
           "header": os.urandom(8192) + raw[8192:]}[damage]  # fmt: skip
    with open(path, "r+b") as f:  # in place: the same file, as a faulty disk would
        f.write(new)
        f.truncate(len(new))
    with pytest.raises(LedgerError, match=f"{path}.*vmcache-kv --ledger {path} repair"):
        SharedBudget(path)
    assert not a.acquire(1) and a.rebuilt == 1 and "damaged" in a.fault  # a new file: and
    assert b.available() == 0 and b.rebuilt == 0 and b.rejoined == 1  # b registers in it
    assert held(a) == {a.id: 2, b.id: 3}  # before anybody grows (it used to be a, to 10)
    time.sleep(0.6)
    assert a.acquire(1) and b.available() == 4
    assert held(a) == {a.id: 3, b.id: 3} and a.snapshot()["total_pages"] == 10
    kept = [f for f in os.listdir(path.parent) if ".damaged-" in f and "-journal" not in f]
    assert len(kept) == 1 and (path.parent / kept[0]).read_bytes() == new
    a.close()
    b.close()


def test_a_release_the_ledger_refuses_is_written_by_the_next_call_that_can(path, tmp_path):
    """The path replaced by a symbolic link (to a ledger that claims more pages): every
    holder refuses to follow it, refuses pages instead of raising, and keeps its account;
    once the path is a file again, its row says what it holds: nothing counted high."""
    from vmcache.memory import ledger_admin

    a = SharedBudget(path, 10, rejoin_grace_s=0)
    assert a.acquire(6)
    bait = tmp_path / "bait.db"
    SharedBudget(bait, 1000).close()
    os.unlink(path)
    os.symlink(bait, path)
    assert not a.acquire(1) and a.available() == 0 and "symbolic link" in a.fault
    a.release(4)  # no error: the account drops, the row follows when it can
    assert a.held == 2 and a.faults >= 3
    with pytest.raises(LedgerError, match="symbolic link"):
        SharedBudget(path)
    assert ledger_admin.read(bait).holders == ()  # it never joined the bait
    os.unlink(path)
    assert a.acquire(1) and held(a) == {a.id: 3}
    a.close()


@pytest.mark.parametrize("bad", ["symlink", "world_writable", "other_user", "directory"])
def test_every_opener_refuses_a_ledger_it_cannot_trust(path, tmp_path, bad):
    from vmcache.memory import ledger_admin
    from vmcache.memory.ledger_rows import check_ledger_path

    SharedBudget(path, 10).close()
    target = path
    if bad == "symlink":
        target = tmp_path / "link.db"
        os.symlink(path, target)
    elif bad == "world_writable":
        os.chmod(path, 0o666)
    elif bad == "other_user":
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(path, 12345, -1)
    else:
        target = tmp_path / "dir.db"
        target.mkdir()
    for opener in (lambda: SharedBudget(target), lambda: ledger_admin.read(target),
                   lambda: check_ledger_path(str(target))):  # fmt: skip
        with pytest.raises((LedgerError, ValueError), match=str(target)):
            opener()


def test_repair_moves_a_damaged_ledger_aside_and_leaves_a_good_one(path):
    from vmcache.memory.ledger_admin import read, repair

    a = SharedBudget(path, 10, rejoin_grace_s=0)
    assert a.acquire(2)
    assert repair(path) is None and read(path).held_pages == 2  # readable: untouched
    path.write_bytes(b"not a ledger at all" * 100)
    aside = repair(path)
    assert aside is not None and os.path.exists(aside) and not path.exists()
    assert a.acquire(1) and read(path).held_pages == 3  # a rebuilt it from its account
    a.close()


def _capped_after_a_rebuild(path, held: int, floor: int = 0):
    """``a`` holding ``held`` of 100 with ``floor``; the file deleted; ``b`` takes 80 in the
    new file; ``a`` rejoins capped at the 20 left, shedding the rest."""
    a = SharedBudget(path, 100, min_pages=floor, rejoin_grace_s=0)
    assert a.acquire(held)
    os.unlink(path)
    b = SharedBudget(path, 100, rejoin_grace_s=0)
    assert b.acquire(80)
    a.available()
    return a, b


def test_a_capped_holder_that_sleeps_gets_its_own_limit_back_once_it_fits(path):
    """A sleep's set_limits(min_pages=0) while capped kept the cap as the limit for good
    and cleared the shed flag while the holder held more than it."""
    a, b = _capped_after_a_rebuild(path, 30)
    assert (a.max, a.shed, a.excess()) == (20, True, 10)
    a.set_limits(min_pages=0)  # as Keeper.sleep does
    assert a.shed and a.excess() == 10  # still over: still shedding
    b.close()
    a.release(10)
    assert a.available() == 80 and (a.max, a.shed) == (100, False)  # its own limit back
    a.close()


def test_a_floor_lowered_on_rejoin_and_promised_again_comes_back(path):
    """A floor lowered to what the others' floors left on rejoin was lost for good, and a
    floor promised while capped was written back to the rejoin's."""
    a = SharedBudget(path, 100, min_pages=30, rejoin_grace_s=0)
    assert a.acquire(10)
    os.unlink(path)
    b = SharedBudget(path, 100, min_pages=80, rejoin_grace_s=0)
    a.available()
    assert (a.min, a.max) == (20, 100)  # what b's floor leaves
    b.close()
    a.available()
    assert a.min == 30  # back once there is room
    a.close()
    a, b = _capped_after_a_rebuild(path, 30)
    assert a.promise_floor(15) == 15  # promised while capped: kept
    b.close()
    a.release(10)
    a.available()
    assert (a.min, a.max) == (15, 100)
    a.close()


def test_a_lock_held_by_a_process_that_runs_is_waited_for_not_moved(path):
    """The bound used to move any file whose lock was held past it, a slow holder's too:
    only a stopped holder's lock makes a file stuck. (Another process holds it here,
    awake.)"""
    mine = SharedBudget(path, 10, lock_timeout_s=0.3, rejoin_grace_s=0)
    p = _child(path, """
        b._file.db.execute("BEGIN IMMEDIATE")
        print("ready", flush=True)
        time.sleep(30)
        """)  # fmt: skip
    try:
        assert not mine.acquire(1) and mine.rebuilt == 0 and "lock" in mine.fault
        assert not [f for f in os.listdir(path.parent) if ".stuck-" in f]
    finally:
        p.kill()
        p.wait(timeout=60)
    assert mine.acquire(1) and mine.rebuilt == 0
    mine.close()


def test_a_rebuild_that_cannot_be_made_is_a_refusal_and_the_keepalive_beats_on(path):
    """A damaged ledger that cannot be moved aside (here: its recovery lock's name taken by
    a directory) raised OSError from every serving call and killed the keepalive thread."""
    a = SharedBudget(path, 10, lease_s=0.4, keepalive=True, rejoin_grace_s=0)
    assert a.acquire(2)
    (path.parent / (path.name + ".recover")).mkdir()
    path.write_bytes(os.urandom(4096))
    assert not a.acquire(1) and a.available() == 0 and "damaged" in a.fault
    a.release(1)  # no error
    time.sleep(0.3)
    assert a._beater.is_alive()
    (path.parent / (path.name + ".recover")).rmdir()
    assert a.acquire(1) and held(a) == {a.id: 2}
    a.close()


def test_the_keepalive_never_undoes_an_acquire(path):
    """The keepalive thread wrote the row from the account between acquire's commit and its
    account's update, dropping the pages just taken from the row (another holder then took
    them twice). Hammered here with a thread switch at nearly every bytecode."""
    import sys
    import threading

    b, other = SharedBudget(path, 1000), SharedBudget(path)
    stop = threading.Event()

    def beat():
        while not stop.is_set():
            b.beat()
            time.sleep(0.0005)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=beat)
    t.start()
    try:
        bad = 0
        for _ in range(300):
            assert b.acquire(1)
            bad += held(other)[b.id] != b.held
            b.release(1)
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert bad == 0
    b.close()
    other.close()
