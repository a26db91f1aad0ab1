"""The UI's Prometheus metrics (served on ``--prometheus-serve-addr`` when set).

* ``hubble_ui_clients`` (gauge): pages following the relay now (bounded by ``--max-clients``);
* ``hubble_ui_clients_refused_total`` (counter): pages answered 503 at ``--max-clients``;
* ``hubble_ui_flows_received_total`` (counter): flows read from the relay for all pages;
* ``hubble_ui_relay_errors_total{code}`` (counter): failed or lost GetFlows streams by gRPC
  status code.

Names follow upstream's ``hubble_*`` prefix (upstream hubble-ui exports none of its own).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class Metrics:
    """The metric families in their own registry (one per app, so tests can build several)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.clients = Gauge(
            "hubble_ui_clients", "Pages following the relay", registry=self.registry
        )
        self.clients_refused = Counter(
            "hubble_ui_clients_refused",
            "Pages refused because --max-clients were open",
            registry=self.registry,
        )
        self.flows_received = Counter(
            "hubble_ui_flows_received", "Flows read from the relay", registry=self.registry
        )
        self.relay_errors = Counter(
            "hubble_ui_relay_errors",
            "Failed or lost GetFlows streams",
            ["code"],
            registry=self.registry,
        )
