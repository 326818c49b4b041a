"""For tests that play root and drop to another user: a directory that user can reach, and a way to run as it.

pytest's own ``tmp_path`` lies under a 0700 directory of the user running the tests, so a child that dropped
to the agent's user (or ``nobody``) could not even reach a path inside it; these tests need a directory the
other user can traverse, as a host's /var/lib is.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["reachable_tmp_dir", "run_as_nobody"]


@contextmanager
def reachable_tmp_dir(prefix: str) -> Iterator[Path]:
    """A fresh directory under the system's temporary directory, mode 0755 (any user may traverse and list
    it), named ``prefix...``; removed with everything in it when the block ends."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        path.chmod(0o755)
        yield path
    finally:
        shutil.rmtree(path)


def run_as_nobody(action: Callable[[], object]) -> str:
    """Run ``action`` in a forked child that dropped to nobody; what it printed about itself ("ok" or the
    error). A fresh interpreter could not even be started as nobody here (the Python install lives under
    /root), so the child is a fork."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        try:
            os.setgid(65534)
            os.setuid(65534)
            action()
            report = "ok"
        except BaseException as exc:
            report = f"{type(exc).__name__}: {exc}"
        os.write(write, report.encode()[:4000])
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        report = pipe.read().decode()
    os.waitpid(pid, 0)
    return report
