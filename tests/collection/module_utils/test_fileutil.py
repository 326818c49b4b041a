"""read_capped: the one reader of small files. Each test plants what a careless reader would trip on (a
symlink, a FIFO that would hang it, a directory, a file one byte too long) and asserts the reason given.
read_if_present and create_exclusive, the two uses of it and of atomic writing that callers share, last."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils._fileutil import (
    CappedFileMissingError,
    CappedReadError,
    CappedReadReason,
    create_exclusive,
    read_capped,
    read_if_present,
    read_json_record,
    remove_json_record,
    write_json_record,
)
from ansible_collections.meridian.node.tests.support.shared_tmp import reachable_tmp_dir, run_as_nobody

CAP = 16


def refusal(path: Path, *, nofollow: bool = True, max_bytes: int = CAP) -> CappedReadError:
    with pytest.raises(CappedReadError) as caught:
        read_capped(path, max_bytes, what="test mark", nofollow=nofollow)
    return caught.value


# --- what is read ------------------------------------------------------------------------------------------


def test_a_file_of_exactly_the_cap_is_read_whole(tmp_path: Path) -> None:
    (tmp_path / "mark").write_bytes(b"x" * CAP)
    assert read_capped(tmp_path / "mark", CAP, what="test mark") == b"x" * CAP


def test_an_empty_file_is_empty_bytes(tmp_path: Path) -> None:
    (tmp_path / "mark").write_bytes(b"")
    assert read_capped(str(tmp_path / "mark"), CAP, what="test mark") == b""


def test_a_symlink_is_followed_when_the_caller_asks(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"policy")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert read_capped(tmp_path / "link", CAP, what="test mark", nofollow=False) == b"policy"


def test_a_path_relative_to_a_directory_descriptor_is_read_there(tmp_path: Path) -> None:
    (tmp_path / "mark").write_bytes(b"here")
    directory = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert read_capped("mark", CAP, what="test mark", dir_fd=directory) == b"here"
    finally:
        os.close(directory)


# --- what is refused, and why -----------------------------------------------------------------------------


def test_one_byte_over_the_cap_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "mark"
    path.write_bytes(b"x" * (CAP + 1))
    error = refusal(path)
    assert error.reason is CappedReadReason.TOO_LARGE
    assert str(error) == f"cannot read test mark {path}: it is larger than {CAP} bytes; check that it is the right file"


def test_a_file_that_claims_no_size_is_still_cut_at_the_cap() -> None:
    # /proc files say st_size 0 and hold more: only the read itself can stop at the cap.
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("no /proc on this host")
    assert status.stat().st_size == 0
    assert refusal(status, max_bytes=8).reason is CappedReadReason.TOO_LARGE


def test_a_symlink_planted_where_the_file_belongs_is_refused_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "root-only"
    secret.write_bytes(b"secret")
    (tmp_path / "mark").symlink_to(secret)
    error = refusal(tmp_path / "mark")
    assert error.reason is CappedReadReason.SYMLINK
    assert f"test mark {tmp_path / 'mark'}: it is a symlink" in str(error)
    assert "secret" not in str(error)


def test_a_dangling_symlink_is_refused_as_a_symlink_not_as_missing(tmp_path: Path) -> None:
    (tmp_path / "mark").symlink_to(tmp_path / "nowhere")
    error = refusal(tmp_path / "mark")
    assert error.reason is CappedReadReason.SYMLINK and not isinstance(error, CappedFileMissingError)


def test_a_symlink_loop_when_following_is_unreadable_with_the_systems_reason(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    error = refusal(tmp_path / "a", nofollow=False)
    assert error.reason is CappedReadReason.UNREADABLE and error.errno == errno.ELOOP


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "mark"
    os.mkfifo(path)
    yield path
    # Should a reader block after all, a writer's open releases it so the test fails instead of hanging.
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("nofollow", [True, False], ids=["nofollow", "follow"])
def test_a_fifo_is_refused_without_hanging_the_reader(fifo: Path, nofollow: bool) -> None:
    outcome: list[BaseException | bytes] = []

    def read() -> None:
        try:
            outcome.append(read_capped(fifo, CAP, what="test mark", nofollow=nofollow))
        except BaseException as exc:  # handed to the test's thread
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "read_capped blocked on a FIFO"
    [error] = outcome
    assert isinstance(error, CappedReadError) and error.reason is CappedReadReason.NOT_REGULAR
    assert f"test mark {fifo}: it is a FIFO, not a regular file; put a regular file there" in str(error)


def test_a_directory_is_refused_as_not_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "mark").mkdir()
    error = refusal(tmp_path / "mark")
    assert error.reason is CappedReadReason.NOT_REGULAR and error.errno == errno.EISDIR
    assert "it is a directory, not a regular file" in str(error)


def test_a_socket_is_refused_as_not_a_regular_file() -> None:
    # A socket's path fails the open itself (ENXIO); a short directory keeps it inside sun_path's limit.
    with tempfile.TemporaryDirectory(prefix="mn-") as short, socket.socket(socket.AF_UNIX) as server:
        path = Path(short) / "s"
        server.bind(str(path))
        error = refusal(path)
    assert error.reason is CappedReadReason.NOT_REGULAR and "it is a socket, not a regular file" in str(error)


def test_a_missing_file_is_its_own_refusal_so_callers_can_read_it_as_none_yet(tmp_path: Path) -> None:
    error = refusal(tmp_path / "absent" / "mark")
    assert isinstance(error, CappedFileMissingError) and isinstance(error, MeridianError)
    assert error.reason is CappedReadReason.MISSING and error.errno == errno.ENOENT
    assert str(error) == (
        f"cannot read test mark {tmp_path / 'absent' / 'mark'}: No such file or directory; check the path"
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to nobody (root itself reads any file)")
def test_a_file_the_reader_may_not_read_is_unreadable_with_the_systems_reason() -> None:
    with reachable_tmp_dir("mn-fileutil-") as directory:
        mark = directory / "mark"
        mark.write_bytes(b"x")
        mark.chmod(0)

        def read() -> None:
            try:
                read_capped(mark, 64, what="test mark")
            except CappedReadError as error:
                assert error.reason is CappedReadReason.UNREADABLE and error.errno == errno.EACCES, error
                assert not isinstance(error, CappedFileMissingError), error
                raise

        report = run_as_nobody(read)
    fix = "check the path and the file's permissions"
    assert report == f"CappedReadError: cannot read test mark {mark}: Permission denied; {fix}"


# --- the caller's own checks --------------------------------------------------------------------------------


class _Planted(MeridianError):
    pass


def test_a_callers_check_sees_the_opened_file_and_its_refusal_stands(tmp_path: Path) -> None:
    path = tmp_path / "mark"
    path.write_bytes(b"x")
    os.link(path, tmp_path / "other")
    seen: list[int] = []

    def check(info: os.stat_result) -> None:
        seen.append(info.st_nlink)
        raise _Planted("two links")

    with pytest.raises(_Planted, match="two links"):
        read_capped(path, CAP, what="test mark", check=check)
    assert seen == [2]


def test_a_callers_check_is_not_asked_about_what_is_not_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "mark").mkdir()
    asked: list[os.stat_result] = []
    with pytest.raises(CappedReadError):
        read_capped(tmp_path / "mark", CAP, what="test mark", check=asked.append)
    assert asked == []


# --- the host's small public JSON records (cordon, draining marks) -----------------------------------------


class RecordError(MeridianError):
    """The caller's own error, as cordon_file and drain_marks pass theirs."""


def test_a_json_record_is_written_world_readable_read_back_and_removed_once(tmp_path: Path) -> None:
    path = str(tmp_path / "made" / "record.json")
    assert read_json_record(path, CAP * 4, what="test record", fix="fix it", error=RecordError) is None
    write_json_record(path, {"b": 1, "a": None}, what="test record", error=RecordError)
    assert Path(path).read_bytes() == b'{"a": null, "b": 1}\n'
    assert os.stat(path).st_mode & 0o777 == 0o644
    assert read_json_record(path, CAP * 4, what="test record", fix="fix it", error=RecordError) == {"a": None, "b": 1}
    assert remove_json_record(path, what="test record", error=RecordError) is True
    assert remove_json_record(path, what="test record", error=RecordError) is False


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"{not json", "test record {path} is not JSON"),
        (b"[1, 2]", "test record {path} must be an object, not a JSON list"),
        (b"null", "test record {path} must be an object, not a JSON null"),
        (b"{}" + b" " * CAP * 4, "larger than"),
    ],
)
def test_a_record_that_is_not_a_json_object_raises_the_callers_error_with_its_fix(
    tmp_path: Path, content: bytes, says: str
) -> None:
    path = tmp_path / "record.json"
    path.write_bytes(content)
    with pytest.raises(RecordError) as caught:
        read_json_record(str(path), CAP * 4, what="test record", fix="fix it", error=RecordError)
    assert says.format(path=path) in str(caught.value)
    assert str(caught.value).endswith("; fix it")


def test_a_record_that_cannot_be_written_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    path = str(tmp_path / "file" / "record.json")  # its directory is a file
    with pytest.raises(RecordError, match=f"cannot write test record {path}"):
        write_json_record(path, {}, what="test record", error=RecordError)


# --- read_if_present: a file that may not be there yet --------------------------------------------------------


def test_a_file_not_written_yet_is_none_and_a_planted_symlink_is_the_callers_error(tmp_path: Path) -> None:
    assert read_if_present(tmp_path / "mark", CAP, what="test mark", error=_Planted) is None
    (tmp_path / "elsewhere").write_bytes(b"x")
    (tmp_path / "mark").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(_Planted, match=r"cannot read test mark .*: it is a symlink") as caught:
        read_if_present(tmp_path / "mark", CAP, what="test mark", error=_Planted)
    assert isinstance(caught.value.__cause__, CappedReadError)


# --- create_exclusive: created once, never replaced -----------------------------------------------------------


def test_an_exclusive_file_is_created_whole_with_its_mode_and_no_temporary_file_is_left(tmp_path: Path) -> None:
    assert create_exclusive(tmp_path / "node.key.pem", b"first", 0o600) is True
    assert (tmp_path / "node.key.pem").read_bytes() == b"first"
    assert (tmp_path / "node.key.pem").stat().st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == ["node.key.pem"]


def test_a_second_creator_keeps_the_first_ones_file_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    create_exclusive(tmp_path / "ca.pem", b"first", 0o644)
    assert create_exclusive(tmp_path / "ca.pem", b"second", 0o600) is False
    assert (tmp_path / "ca.pem").read_bytes() == b"first"
    assert (tmp_path / "ca.pem").stat().st_mode & 0o777 == 0o644
    assert os.listdir(tmp_path) == ["ca.pem"]
