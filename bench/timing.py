"""What every benchmark here measures with: the median wall time of repeated runs, and the time a whole bench took."""

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def median_seconds(run: Callable[[], Any], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def run_bench(main: Callable[[], object]) -> None:
    """Run a bench's ``main``, then say how long the whole bench took and on which Python."""
    started = time.perf_counter()
    main()
    print(f"(bench took {time.perf_counter() - started:.0f} s; Python {sys.version.split()[0]})")
