"""Metrics: where kvconnect's figures are named, collected and formatted.

Everything an operator watches is defined once, in ``CATALOGUE`` (Prometheus names with
units: ``_bytes``, ``_seconds``, ``_total``). Figures are *pulled*: the hot path only bumps
the counters it already keeps (EngineStats, the pool's, each tier's and writer's) plus two
cheap recorders (``LatencyHistogram``, ``TierMeter``); a ``Figures`` snapshot is built from
them when someone asks, and turned into

- Prometheus samples (``KVConnectCollector``, one per registry, serving every engine of the
  process under an ``instance`` label: several engines never register twice);
- vLLM's KV-connector stats payload (``vllm_payload`` / ``merge_payloads``, cumulative per
  rank, so that vLLM's per-worker and per-interval aggregation cannot double count) and the
  increments its Prometheus hook records (``PayloadDeltas``);
- SGLang's storage-metrics shape (``sglang_storage_metrics``: pages and GB/s per operation);
- an opt-in HTTP exporter (``start_exporter``; loopback unless configured otherwise).

Histograms keep fixed buckets (``LATENCY_BUCKETS_S``); an observation costs a bisect and a
lock. See docs/operations.md for what each figure means and its healthy values.

One module per concept; callers import from the module that defines a name:

- ``catalogue``: ``CATALOGUE``, ``Metric``, the buckets, the ``Figures`` snapshot;
- ``recorders``: the hot-path recorders ``LatencyHistogram``, ``TierMeter``, ``OpLog``;
- ``figures``: ``storage_figures``, ``engine_figures``, ``server_figures``;
- ``prometheus``: the collector, ``register_engine``, ``start_exporter``;
- ``vllm``: vLLM's payload, ``PayloadDeltas``, ``VllmPromMetrics``, ``ReportGate``;
- ``sglang``: ``sglang_storage_metrics``.

They sit below the engine and the storage manager (both import them) and import neither; the
package imports nothing of kvconnect outside itself (engines and config come in as arguments).
"""
