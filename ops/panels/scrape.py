"""Time series built from repeated scrapes of a Prometheus text endpoint, kept in memory.

This stands in for Prometheus's storage during `make demo`: a thread scrapes Ray's metrics exporter
every couple of seconds, and the PromQL evaluator (`shunter.ops.panels.promql`) reads the result. Samples are
stamped with the time of the scrape, not with any timestamp in the exposition (Ray writes none), so
every series of one scrape shares one instant, just as Prometheus stores them.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

Labels = frozenset[tuple[str, str]]
Point = tuple[float, float]


def freeze_labels(labels: Mapping[str, str]) -> Labels:
    """A hashable, order-free label set: the identity of a series together with its metric name."""
    return frozenset(labels.items())


class SampleStore:
    """Every sample of every scrape, per series (metric name + label set), in time order.

    Names are kept exactly as exposed, suffix included (`_bucket`, `_sum`, `_count`, `_total`), because
    that is what PromQL selectors name. A lock guards the data: the scrape loop writes from its own
    thread while a renderer may already read.
    """

    def __init__(self) -> None:
        self._data: dict[str, dict[Labels, list[Point]]] = {}
        self._times: list[float] = []
        self._lock = threading.Lock()

    def add_scrape(self, text: str, at: float) -> int:
        """Parse one exposition and store its samples at time `at`; returns how many were stored.

        The whole text is parsed before anything is stored, so a malformed scrape (ValueError) leaves
        the store as it was instead of half-written.
        """
        samples = [
            (sample.name, freeze_labels(sample.labels), float(sample.value))
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]
        with self._lock:
            self._note_time(at)
            for name, labels, value in samples:
                self._insert(name, labels, at, value)
        return len(samples)

    def add_sample(self, name: str, labels: Mapping[str, str], at: float, value: float) -> None:
        """Store one sample directly (tests, or a source that is not Prometheus text)."""
        with self._lock:
            self._note_time(at)
            self._insert(name, freeze_labels(labels), at, float(value))

    def _note_time(self, at: float) -> None:
        index = bisect.bisect_left(self._times, at)
        if index == len(self._times) or self._times[index] != at:
            self._times.insert(index, at)

    def _insert(self, name: str, labels: Labels, at: float, value: float) -> None:
        points = self._data.setdefault(name, {}).setdefault(labels, [])
        if not points or points[-1][0] <= at:
            points.append((at, value))  # the usual case: scrapes arrive in time order
        else:
            bisect.insort(points, (at, value))

    def series(self, name: str) -> dict[Labels, list[Point]]:
        """All series of one metric name: label set -> [(time, value)] in time order (copies)."""
        with self._lock:
            return {labels: list(points) for labels, points in self._data.get(name, {}).items()}

    def names(self) -> list[str]:
        """Every metric name seen, sorted (selectors that match `__name__` by regex need them all)."""
        with self._lock:
            return sorted(self._data)

    def times(self) -> list[float]:
        """The instants of all scrapes, in order: the time axis a renderer evaluates over."""
        with self._lock:
            return list(self._times)

    def scrape_interval(self) -> float | None:
        """Median gap between scrapes, or None before the second one; sizes `$__rate_interval`."""
        times = self.times()
        gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False) if b > a)
        return gaps[len(gaps) // 2] if gaps else None


def scrape_once(client: httpx.Client, url: str, store: SampleStore) -> int:
    """Fetch `url` and store what it exposes, stamped with the time the reply arrived."""
    response = client.get(url)
    response.raise_for_status()
    return store.add_scrape(response.text, time.time())


def scrape_loop(url: str, store: SampleStore, interval_s: float, stop_event: threading.Event,
                client: httpx.Client | None = None, timeout_s: float = 5.0) -> int:
    """Scrape `url` every `interval_s` until `stop_event` is set; returns the number of good scrapes.

    A failed scrape (connection refused while the app starts, a 5xx, a malformed body) is logged and
    skipped rather than raised: one gap in a demo's time series is better than losing the whole run.
    Meant to run in a thread; `client` can be injected so tests need no server.
    """
    own_client = client is None
    http = client if client is not None else httpx.Client(timeout=timeout_s)
    good = 0
    try:
        while not stop_event.is_set():
            started = time.monotonic()
            try:
                scrape_once(http, url, store)
                good += 1
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("scrape of %s failed: %s", url, exc)
            stop_event.wait(max(0.0, interval_s - (time.monotonic() - started)))
    finally:
        if own_client:
            http.close()
    return good
