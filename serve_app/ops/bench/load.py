"""How `baton bench` loads a server: a fixed number of requests in flight, or Poisson
arrivals at a rate, each a thread blocked on its stream (the client's own cost is a
read per chunk)."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from serve_app.ops.bench.stream_client import RequestResult
from serve_app.ops.bench.workload import BenchRequest

Send = Callable[[BenchRequest], RequestResult]


class Progress:
    """A one-line progress bar on stderr, redrawn as requests end."""

    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled = label, total, enabled
        self.done = self.failed = 0
        self._lock = threading.Lock()

    def ended(self, result: RequestResult) -> None:
        with self._lock:
            self.done += 1
            self.failed += not result.ok
            if self.enabled:
                filled = 30 * self.done // self.total
                sys.stderr.write(
                    f"\r{self.label:>16} [{'#' * filled}{'.' * (30 - filled)}] "
                    f"{self.done}/{self.total} ({self.failed} failed)"
                )
                if self.done == self.total:
                    sys.stderr.write("\n")
                sys.stderr.flush()


def at_concurrency(
    send: Send, requests: list[BenchRequest], concurrency: int, progress: Progress
) -> tuple[list[RequestResult], float]:
    """Every request, `concurrency` at a time (closed loop); (results, seconds)."""
    if concurrency < 1:
        raise ValueError(f"--concurrency values must be >= 1, got {concurrency}")

    def one(request: BenchRequest) -> RequestResult:
        result = send(request)
        progress.ended(result)
        return result

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, requests))
    return results, time.perf_counter() - start


def at_rate(
    send: Send, requests: list[BenchRequest], rate: float, seed: int, progress: Progress
) -> tuple[list[RequestResult], float]:
    """Every request, arriving as a Poisson process of `rate` a second (open loop: an
    arrival never waits for an earlier request); (results, seconds)."""
    if rate <= 0:
        raise ValueError(f"--request-rate values must be > 0, got {rate}")
    rng = random.Random(seed)
    results: list[RequestResult | None] = [None] * len(requests)

    def one(index: int) -> None:
        results[index] = send(requests[index])
        progress.ended(results[index])

    start = time.perf_counter()
    threads = []
    arrival = start
    for index in range(len(requests)):
        arrival += rng.expovariate(rate)
        time.sleep(max(0.0, arrival - time.perf_counter()))
        thread = threading.Thread(target=one, args=(index,), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return [r for r in results if r is not None], time.perf_counter() - start
