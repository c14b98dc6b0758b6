"""Prometheus, standalone: the process's collector and the opt-in HTTP exporter.

``KVConnectCollector`` (one per registry) serves every engine of the process under an
``instance`` label, so several engines never register twice; ``start_exporter`` starts an
HTTP exporter once (loopback unless configured otherwise). Part of ``kvconnect.metrics``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from .catalogue import CATALOGUE, COUNTER, GAUGE, HISTOGRAM, LATENCY_BUCKETS_S, Figures
from .figures import EngineLike, engine_figures

if TYPE_CHECKING:
    from ..config import Config

logger = logging.getLogger("kvconnect.metrics")  # the package's name: one logger for every figure's warnings


def _families(figures: Figures, extra_labels: dict[str, str]) -> dict[str, Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    fams: dict[str, Any] = {}
    names, values = list(extra_labels), list(extra_labels.values())
    for name, series in figures.values.items():
        m = CATALOGUE[name]
        labelnames = names + list(m.labels)
        if m.kind == COUNTER:
            fam = CounterMetricFamily(name, m.help, labels=labelnames)
        elif m.kind == GAUGE:
            fam = GaugeMetricFamily(name, m.help, labels=labelnames)
        else:
            fam = HistogramMetricFamily(name, m.help + " (seconds)", labels=labelnames)
        for labels, value in series.items():
            if m.kind == HISTOGRAM:
                counts, total = value
                cumulative = list(itertools.accumulate(counts))
                bounds = [repr(b) for b in LATENCY_BUCKETS_S] + ["+Inf"]
                fam.add_metric(values + list(labels), list(zip(bounds, cumulative)), total)
            else:
                fam.add_metric(values + list(labels), value)
        fams[name] = fam
    return fams


class KVConnectCollector:
    """Serves every registered source of this process; registered once per registry."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[str, Callable[[], Optional[Figures]]] = {}
        self._counter = itertools.count()

    def add(self, source: Callable[[], Optional[Figures]], instance: Optional[str] = None) -> str:
        with self._lock:
            name = instance or f"engine-{next(self._counter)}"
            while name in self._sources:
                name = f"{instance or 'engine'}-{next(self._counter)}"
            self._sources[name] = source
            return name

    def remove(self, instance: str) -> None:
        with self._lock:
            self._sources.pop(instance, None)

    def instances(self) -> list[str]:
        with self._lock:
            return list(self._sources)

    def collect(self) -> Iterable[Any]:
        with self._lock:
            sources = list(self._sources.items())
        merged: dict[str, Any] = {}
        for instance, source in sources:
            try:
                figures = source()
            except Exception:  # a closing engine must not break the scrape of the others
                logger.debug("kvconnect: metrics source %s failed", instance, exc_info=True)
                continue
            if figures is None:
                continue
            for name, fam in _families(figures, {"instance": instance}).items():
                if name in merged:
                    merged[name].samples.extend(fam.samples)
                else:
                    merged[name] = fam
        return list(merged.values())


_COLLECTORS: "weakref.WeakKeyDictionary[Any, KVConnectCollector]" = weakref.WeakKeyDictionary()
_COLLECTORS_LOCK = threading.Lock()


def collector(registry: Any = None) -> KVConnectCollector:
    """The process's collector in ``registry`` (default: prometheus_client's REGISTRY), made once."""
    from prometheus_client import REGISTRY

    registry = REGISTRY if registry is None else registry
    with _COLLECTORS_LOCK:
        c = _COLLECTORS.get(registry)
        if c is None:
            c = _COLLECTORS[registry] = KVConnectCollector()
            registry.register(c)
        return c


def register_engine(engine: EngineLike, instance: Optional[str] = None, registry: Any = None) -> Optional[str]:
    """Serve ``engine``'s figures from the process's collector; its instance label, or None
    when prometheus_client is not installed (the engine works without metrics)."""
    try:
        c = collector(registry)
    except ImportError:
        return None
    ref = weakref.ref(engine)

    def source() -> Optional[Figures]:
        e = ref()
        return engine_figures(e) if e is not None else None

    name = c.add(source, instance)
    weakref.finalize(engine, c.remove, name)  # an engine dropped without close() leaves no entry
    return name


def unregister(instance: Optional[str], registry: Any = None) -> None:
    if instance is None:
        return
    try:
        collector(registry).remove(instance)
    except ImportError:
        pass


def prometheus_text(registry: Any = None) -> str:
    from prometheus_client import REGISTRY, generate_latest

    return generate_latest(REGISTRY if registry is None else registry).decode()


_EXPORTER_LOCK = threading.Lock()
_EXPORTER: Optional[tuple[str, int]] = None


def start_exporter(config: "Config") -> Optional[tuple[str, int]]:
    """Start the process's HTTP exporter once (``KVCONNECT_METRICS_PORT`` > 0), on
    ``KVCONNECT_METRICS_HOST`` (loopback by default). Returns (host, port) or None when off.
    A port already taken is logged, never raised: metrics must not stop an engine."""
    global _EXPORTER
    if config.metrics_port <= 0:
        return None
    with _EXPORTER_LOCK:
        if _EXPORTER is None:
            try:
                from prometheus_client import start_http_server

                collector()
                start_http_server(config.metrics_port, addr=config.metrics_host)
                _EXPORTER = (config.metrics_host, config.metrics_port)
                logger.info("kvconnect: metrics on http://%s:%d/metrics", *_EXPORTER)
            except (ImportError, OSError) as exc:
                logger.warning("kvconnect: metrics exporter not started on %s:%d: %s", config.metrics_host, config.metrics_port, exc)
                return None
        return _EXPORTER
