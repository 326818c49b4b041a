"""The durable applied state: it only moves forward, survives restarts, and never silently resets."""

import fcntl
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from ansible_collections.meridian.node.plugins.module_utils._fileutil import atomic_write
from ansible_collections.meridian.node.plugins.module_utils.trust.applied_state import StateStore, StateStoreError
from ansible_collections.meridian.node.plugins.module_utils.trust.verify import AcceptedState, AppliedState
from ansible_collections.meridian.node.tests.support.shared_tmp import reachable_tmp_dir, run_as_nobody

SHA_A = "a" * 64
SHA_B = "b" * 64


def inode(path: Path) -> int:
    return path.stat().st_ino


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


# --- normal life ----------------------------------------------------------------------------------------


def test_fresh_host_has_applied_nothing(tmp_path: Path) -> None:
    assert StateStore(tmp_path).load() == AppliedState(0, 0, None)
    assert not (tmp_path / "applied.json").exists()


def test_recorded_state_survives_a_restart(tmp_path: Path) -> None:
    StateStore(tmp_path).record_applied(3, 2, SHA_A)
    assert StateStore(tmp_path).load() == AppliedState(3, 2, SHA_A)
    document = json.loads((tmp_path / "applied.json").read_text())
    assert document == {"format": 2, "generation": 3, "epoch": 2, "payload_sha256": SHA_A, "accepted": None}
    assert stat.S_IMODE((tmp_path / "applied.json").stat().st_mode) == 0o600
    assert leftovers(tmp_path) == []


def test_state_dir_is_created_when_missing(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "var" / "lib" / "meridian-node")
    store.record_applied(1, 0, SHA_A)
    assert store.load().generation == 1


def test_observed_epoch_is_kept_alongside_the_generation(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.record_applied(3, 2, SHA_A)
    assert store.observe_epoch(5) == AppliedState(3, 5, SHA_A)
    assert StateStore(tmp_path).load() == AppliedState(3, 5, SHA_A)


def test_newer_generation_replaces_the_record(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.record_applied(3, 2, SHA_A)
    store.record_applied(4, 2, SHA_B)
    assert store.load() == AppliedState(4, 2, SHA_B)


def test_recording_the_same_state_again_does_not_rewrite_the_file(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.record_applied(3, 2, SHA_A)
    before = inode(store.path)
    store.record_applied(3, 2, SHA_A)
    store.observe_epoch(2)
    assert inode(store.path) == before  # atomic_write would have made a new inode


def test_a_change_rewrites_the_file_atomically(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.record_applied(3, 2, SHA_A)
    before = inode(store.path)
    store.observe_epoch(3)
    assert inode(store.path) != before
    assert leftovers(tmp_path) == []


# --- refusing to go backwards ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("generation", "message"),
    [
        pytest.param(4, "refusing to record generation 4: generation 5 is already applied", id="lower-generation"),
        pytest.param(5, "a generation is never reused", id="same-generation-other-content"),
    ],
)
def test_going_backwards_is_refused_and_nothing_changes(tmp_path: Path, generation: int, message: str) -> None:
    store = StateStore(tmp_path)
    store.record_applied(5, 1, SHA_A)
    with pytest.raises(StateStoreError, match=message):
        store.record_applied(generation, 1, SHA_B)
    assert store.load() == AppliedState(5, 1, SHA_A)


def test_an_epoch_that_rose_while_the_apply_ran_is_kept_and_the_generation_still_recorded(tmp_path: Path) -> None:
    # The apply of generation 1 was decided under epoch 3; a lease renewal saw epoch 4 while it ran. The
    # host runs generation 1 now, so the record must say so, and the epoch must not go back to 3.
    store = StateStore(tmp_path)
    store.observe_epoch(3)
    store.observe_epoch(4)
    assert store.record_applied(1, 3, SHA_A) == AppliedState(1, 4, SHA_A)
    assert store.load() == AppliedState(1, 4, SHA_A)


def test_lower_epoch_is_refused_when_observing(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.observe_epoch(4)
    with pytest.raises(StateStoreError, match="epoch never goes down"):
        store.observe_epoch(2)
    assert store.load().epoch == 4


@pytest.mark.parametrize(
    ("generation", "epoch", "digest", "message"),
    [
        (0, 0, SHA_A, "generation must be an integer >= 1"),
        (True, 0, SHA_A, "generation must be an integer >= 1"),
        (1, -1, SHA_A, "epoch must be an integer >= 0"),
        (1, 0, "A" * 64, "payload_sha256 must be 64 lowercase hex"),
        (1, 0, "abc", "payload_sha256 must be 64 lowercase hex"),
    ],
)
def test_nonsense_records_are_refused(tmp_path: Path, generation: int, epoch: int, digest: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StateStore(tmp_path).record_applied(generation, epoch, digest)
    assert not (tmp_path / "applied.json").exists()


# --- damaged files --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        pytest.param(b"", "not JSON", id="empty-after-a-crash"),
        pytest.param(b'{"format": 1, "generation": 3', "not JSON", id="truncated"),
        pytest.param(b"\xff\xfe", "not JSON", id="binary"),
        pytest.param(b"[3, 2]", "expected a JSON object", id="list"),
        pytest.param(b'{"format": 1, "generation": 3, "epoch": 2}', "expected exactly the fields", id="missing-field"),
        pytest.param(
            b'{"format": 3, "generation": 3, "epoch": 2, "payload_sha256": null}',
            "unknown format 3",
            id="future-format",
        ),
        pytest.param(
            b'{"format": 2, "generation": 0, "epoch": 2, "payload_sha256": null}',
            "expected exactly the fields",
            id="format-2-without-accepted",
        ),
        pytest.param(
            b'{"format": 2, "generation": 3, "epoch": 2, "payload_sha256": "' + b"a" * 64 + b'", "accepted": '
            b'{"generation": 3, "epoch": 2, "payload_sha256": "' + b"b" * 64 + b'"}}',
            "accepted.generation 3 is not above the applied generation 3",
            id="accepted-not-above-applied",
        ),
        pytest.param(
            b'{"format": 2, "generation": 0, "epoch": 2, "payload_sha256": null, "accepted": {"generation": 4}}',
            "accepted must be null or an object with exactly the fields",
            id="accepted-missing-fields",
        ),
        pytest.param(
            b'{"format": 1, "generation": -1, "epoch": 2, "payload_sha256": null}',
            "generation must be an integer >= 0, got -1",
            id="negative-generation",
        ),
        pytest.param(
            b'{"format": 1, "generation": 0, "epoch": true, "payload_sha256": null}',
            "epoch must be an integer >= 0, got True",
            id="boolean-epoch",
        ),
        pytest.param(
            b'{"format": 1, "generation": 3, "epoch": 2, "payload_sha256": null}',
            "generation 3 is recorded without its payload_sha256",
            id="generation-without-hash",
        ),
        pytest.param(
            b'{"format": 1, "generation": 3, "epoch": 2, "payload_sha256": "xyz"}',
            "payload_sha256 must be 64 lowercase hex",
            id="bad-hash",
        ),
    ],
)
def test_corrupt_state_file_is_an_error_not_a_reset(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "applied.json"
    path.write_bytes(content)
    store = StateStore(tmp_path)
    with pytest.raises(StateStoreError) as info:
        store.load()
    message = str(info.value)
    assert f"the applied-state file {path} is corrupt" in message
    assert reason in message
    assert "Restore it from a backup" in message
    # Writers refuse too, and leave the evidence alone.
    with pytest.raises(StateStoreError):
        store.record_applied(9, 9, SHA_A)
    assert path.read_bytes() == content


def test_unreadable_state_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "applied.json").mkdir()
    with pytest.raises(StateStoreError, match="cannot read the applied-state file"):
        StateStore(tmp_path).load()


# --- atomic_write ---------------------------------------------------------------------------------------


def test_atomic_write_replaces_content_and_sets_the_mode(tmp_path: Path) -> None:
    target = tmp_path / "file.json"
    target.write_bytes(b"old")
    atomic_write(target, b"new", mode=0o640)
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    atomic_write(str(target), b"")
    assert target.read_bytes() == b""
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert leftovers(tmp_path) == []


def test_failed_atomic_write_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    # The rename fails (the target is a non-empty directory); the temp file must not be left behind.
    target = tmp_path / "busy"
    target.mkdir()
    (target / "child").write_bytes(b"x")
    with pytest.raises(OSError):
        atomic_write(target, b"data")
    assert (target / "child").read_bytes() == b"x"
    assert leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A temporary directory other users can reach (pytest's own lives under a 0700 directory)."""
    with reachable_tmp_dir("mn-state-") as path:
        yield path


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play the root apply unit and drop to another user")
def test_another_user_can_neither_read_nor_lock_roots_record(shared_tmp: Path) -> None:
    # Root's directory is 0711 (reachable by name): the agent's user tries every file root's record keeps.
    state_dir = shared_tmp / "state"
    state_dir.mkdir(mode=0o711)
    StateStore(state_dir).record_applied(3, 1, SHA_A)
    for name in ("applied.json", "applied.json.lock"):
        assert stat.S_IMODE((state_dir / name).stat().st_mode) == 0o600

        def attempt(path: Path = state_dir / name) -> None:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

        assert run_as_nobody(attempt).startswith("PermissionError"), name


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play the root apply unit and drop to another user")
def test_a_lock_left_open_to_others_by_an_older_release_is_replaced_not_waited_on(shared_tmp: Path) -> None:
    # An older release created applied.json.lock 0644: the agent's user opened it read-only and holds its flock.
    state_dir = shared_tmp / "state"
    state_dir.mkdir(mode=0o711)
    StateStore(state_dir).record_applied(3, 1, SHA_A)
    lock = state_dir / "applied.json.lock"
    lock.chmod(0o644)
    old_inode = inode(lock)
    holding, release = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(65534)
            os.setuid(65534)
            fd = os.open(lock, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(ready_w, b"held")
            os.read(holding, 1)  # until the test is done
        finally:
            os._exit(0)
    try:
        assert os.read(ready_r, 4) == b"held"
        store = StateStore(state_dir, lock_wait_s=2)
        assert store.record_accepted(4, 1, SHA_B) == AppliedState(3, 1, SHA_A, AcceptedState(4, 1, SHA_B))
    finally:
        os.write(release, b"x")
        os.waitpid(pid, 0)
    assert inode(lock) != old_inode
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600


@pytest.mark.timeout(60)  # a block without end fails here instead of hanging the suite
def test_a_lock_held_past_the_wait_is_an_error_naming_it_never_a_block(tmp_path: Path) -> None:
    store = StateStore(tmp_path, lock_wait_s=0.3)
    store.record_applied(3, 1, SHA_A)
    fd = os.open(tmp_path / "applied.json.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(StateStoreError, match=r"applied.json.lock\) is busy.*longer than 0.3 s.*fuser -v"):
            store.record_accepted(4, 1, SHA_B)
    finally:
        os.close(fd)
    assert store.load() == AppliedState(3, 1, SHA_A)


# --- accepted: the floor moves at the decision ----------------------------------------------------------


def test_accepting_a_generation_moves_the_floor_before_its_apply(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.record_applied(3, 1, SHA_A)
    assert store.record_accepted(4, 2, SHA_B) == AppliedState(3, 2, SHA_A, AcceptedState(4, 2, SHA_B))
    document = json.loads((tmp_path / "applied.json").read_text())
    assert document["accepted"] == {"generation": 4, "epoch": 2, "payload_sha256": SHA_B}
    assert StateStore(tmp_path).load().accepted_generation == 4


def test_a_generation_below_the_accepted_one_is_refused_even_though_it_was_never_applied(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.record_applied(3, 1, SHA_A)
    store.record_accepted(5, 1, SHA_B)  # its apply then failed, hung or was killed
    for record in (store.record_accepted, store.record_applied):
        with pytest.raises(StateStoreError, match="generation 5 was accepted since"):
            record(4, 1, SHA_A)
    with pytest.raises(StateStoreError, match=r"it was accepted with sha256 b{64}.*never reused"):
        store.record_accepted(5, 1, SHA_A)
    assert store.load() == AppliedState(3, 1, SHA_A, AcceptedState(5, 1, SHA_B))


def test_the_accepted_bytes_may_be_accepted_again_and_then_recorded_applied(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.record_applied(3, 1, SHA_A)
    accepted = store.record_accepted(5, 1, SHA_B)
    assert store.record_accepted(5, 1, SHA_B) == accepted  # the retry: nothing to write
    assert store.record_applied(5, 1, SHA_B) == AppliedState(5, 1, SHA_B)
    assert json.loads((tmp_path / "applied.json").read_text())["accepted"] is None
    # Repairing the applied generation accepts nothing new.
    assert store.record_accepted(5, 1, SHA_B) == AppliedState(5, 1, SHA_B)


def test_accepting_keeps_the_highest_epoch_and_observing_keeps_the_accepted(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.record_accepted(2, 3, SHA_A)
    assert store.observe_epoch(4) == AppliedState(0, 4, None, AcceptedState(2, 3, SHA_A))
    assert store.record_accepted(3, 2, SHA_B) == AppliedState(0, 4, None, AcceptedState(3, 2, SHA_B))


def test_a_format_1_record_reads_as_accepted_equals_applied(tmp_path: Path) -> None:
    (tmp_path / "applied.json").write_text(
        json.dumps({"format": 1, "generation": 3, "epoch": 2, "payload_sha256": SHA_A})
    )
    store = StateStore(tmp_path)
    assert store.load() == AppliedState(3, 2, SHA_A)
    store.record_accepted(4, 2, SHA_B)
    assert json.loads((tmp_path / "applied.json").read_text())["format"] == 2


def test_a_reader_sees_what_another_writer_recorded_after_its_own_read(tmp_path: Path) -> None:
    # The agent keeps one StateStore and reads it every cycle; the root apply unit records through its own.
    reader, writer = StateStore(tmp_path), StateStore(tmp_path)
    writer.record_applied(1, 1, SHA_A)
    assert reader.load() == AppliedState(1, 1, SHA_A)
    for generation in range(2, 6):  # quick successive writes of the same size: the cache must not hide one
        writer.record_applied(generation, 1, SHA_A)
        assert reader.load() == AppliedState(generation, 1, SHA_A)


def test_renewal_under_the_recorded_epoch_writes_nothing(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.record_applied(1, 4, SHA_A)
    before = inode(tmp_path / "applied.json")

    assert store.observe_epoch(4) == AppliedState(1, 4, SHA_A)
    assert inode(tmp_path / "applied.json") == before
    with pytest.raises(StateStoreError, match="never goes down"):
        store.observe_epoch(3)
