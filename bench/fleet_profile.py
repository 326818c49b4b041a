"""bench/fleet.py ``--profile``: where the server's time goes during a step's window, from py-spy's samples.

py-spy (``pip install py-spy`` into the venv) samples the server process from outside (``--nonblocking``: the
server is never paused), 100 times a second, idle samples included, and writes collapsed stacks
(``frame;frame;... count``). From them: the share of samples in which each function is the innermost frame
(self) and in which one of the devserver's own functions is anywhere on the stack (inclusive; counted once per
sample: the library frames around them, uvicorn's and starlette's, are on every stack), and the share of idle
samples (the event loop waiting in ``select``/``epoll``), so what is left is what the one server core spends
its time on.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Profile", "record", "summarise"]

RATE = 100
IDLE = "select (selectors.py"  # the event loop waiting in epoll (EpollSelector.select): nothing to do
_LINE = re.compile(r":\d+\)$")
OWN = "meridian_node_agent/"  # the devserver's own frames: what the inclusive list shows


@dataclass(frozen=True)
class Profile:
    samples: int
    idle: int
    self_share: list[tuple[str, float]]  # (frame, share of all samples), largest first
    inclusive_share: list[tuple[str, float]]  # the devserver's own frames only

    def text(self, top: int = 15) -> str:
        busy = self.samples - self.idle
        lines = [f"{self.samples} samples, {100 * busy / max(1, self.samples):.0f} % busy (not waiting in epoll)"]
        lines.append("self (innermost frame), share of all samples:")
        lines += [f"  {100 * share:5.1f} %  {frame}" for frame, share in self.self_share[:top]]
        lines.append("inclusive (anywhere on the stack), the devserver's own functions, share of all samples:")
        lines += [f"  {100 * share:5.1f} %  {frame}" for frame, share in self.inclusive_share[:top]]
        return "\n".join(lines)


async def record(pid: int, seconds: float, output: Path) -> None:
    """Sample ``pid`` for ``seconds`` into ``output`` (collapsed stacks)."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    process = await asyncio.create_subprocess_exec(
        py_spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(RATE),
        "--format", "raw", "--nonblocking", "--idle", "--output", str(output),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _out, err = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"py-spy exited {process.returncode}: {err.decode(errors='replace')[-2000:]}")


def summarise(collapsed: Path) -> Profile:
    leaves: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    samples = idle = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_LINE.sub(")", frame) for frame in stack.split(";")]  # a function, not a line of it
        samples += count
        if IDLE in frames[-1]:
            idle += count
            continue
        leaves[frames[-1]] += count
        for frame in set(frames):
            if OWN in frame:
                anywhere[frame] += count
    total = max(1, samples)
    return Profile(
        samples,
        idle,
        [(frame, count / total) for frame, count in leaves.most_common()],
        [(frame, count / total) for frame, count in anywhere.most_common()],
    )
