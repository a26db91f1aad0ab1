"""``certs generate``: the standalone control plane's CA, server and client certificates."""

from __future__ import annotations

import ipaddress
from typing import IO

from cilia_common.tls import (
    TLSFileError,
    generate_bundle,
)

from .connection import (
    CommandError,
)


def _host_name_error(host: str) -> str:
    """Why ``host`` cannot be a certificate's subjectAltName, or "" when it can: an IPv4 or
    IPv6 address, or a DNS name of RFC 1123 labels (letters, digits, '-', 1-63 characters,
    not starting or ending with '-'; at most 253 characters)."""
    try:
        ipaddress.ip_address(host)
        return ""
    except ValueError:
        pass
    labels = host.split(".")
    if not host or len(host) > 253:
        return "not an IP address or a DNS name (1-253 characters)"
    for label in labels:
        ok = (
            0 < len(label) <= 63
            and label[0] != "-"
            and label[-1] != "-"
            and all(c.isascii() and (c.isalnum() or c == "-") for c in label)
        )
        if not ok:
            return f"not an IP address or a DNS name (label {label!r}: letters, digits, '-')"
    return ""


def certs_generate(
    directory: str,
    hosts: list[str],
    nodes: list[str],
    admins: list[str],
    days: float,
    out: IO[str],
    *,
    hubble_cluster: str | None = None,
) -> None:
    """Write the control plane's CA, the operator's server pair, one client pair per node and
    per admin into ``directory`` (``ca.crt``/``ca.key`` reused when present, so new nodes
    can be added later) and print the flags that use them; with ``hubble_cluster`` also
    Hubble's (each node's server pair, the relay's client and server pairs, hubble-ui's
    client pair).

    Raises:
        CommandError: bad node or Hubble cluster name (one line), no host, or the directory
            cannot be written.
    """
    import pydantic

    from ..ipam.pool import ObjectMeta

    names = [("--nodes", node) for node in nodes]
    if hubble_cluster is not None:  # the middle label of each node's <node>.<cluster>.hubble-grpc…
        names.append(("--hubble-cluster", hubble_cluster))
    for flag, name in names:
        try:
            ObjectMeta(name=name)
        except ValueError as exc:
            # pydantic's text is several lines (model, field, docs link): its message only
            why = exc.errors()[0]["msg"] if isinstance(exc, pydantic.ValidationError) else exc
            raise CommandError(f"{flag}: {name!r}: {why}") from None
    for host in hosts:
        why = _host_name_error(host)
        if why:
            raise CommandError(f"--hosts: {host!r}: {why}")
    try:
        bundle = generate_bundle(
            directory, server_hosts=hosts, nodes=nodes, admins=admins, days=days,
            hubble_cluster=hubble_cluster,
        )  # fmt: skip
    except NotADirectoryError as exc:
        raise CommandError(f"--dir: {exc}") from None
    except (ValueError, OSError, TLSFileError) as exc:
        raise CommandError(str(exc)) from None
    print(f"CA:       {bundle.ca_cert} (key {bundle.ca_key}: keep it off the nodes)", file=out)
    print(f"operator: --tls-cert-file {bundle.server_cert} --tls-key-file {bundle.server_key} "
          f"--tls-client-ca-files {bundle.ca_cert}", file=out)  # fmt: skip
    for name, (cert, key) in bundle.clients.items():
        print(f"{name}: --tls-operator-server-ca-files {bundle.ca_cert} "
              f"--tls-operator-client-cert-file {cert} --tls-operator-client-key-file {key}",
              file=out)  # fmt: skip
    for name, (cert, key) in bundle.hubble.items():
        if name == "hubble-relay-client":
            flags = (f"--tls-hubble-server-ca-files {bundle.ca_cert} --tls-client-cert-file "
                     f"{cert} --tls-client-key-file {key}")  # fmt: skip
        elif name == "hubble-ui-client":
            flags = (f"--tls-relay-ca-cert-files {bundle.ca_cert} --tls-relay-client-cert-file "
                     f"{cert} --tls-relay-client-key-file {key} --tls-relay-server-name "
                     f"ui.hubble-relay.cilium.io (cilia-hubble-ui; Secret "
                     f"hubble-ui-client-certs: tls.crt, tls.key, ca.crt)")  # fmt: skip
        elif name == "hubble-relay-server":
            flags = (f"--tls-relay-server-cert-file {cert} --tls-relay-server-key-file {key} "
                     f"(clients: hubble --tls --tls-ca-cert-files {bundle.ca_cert})")  # fmt: skip
        else:
            flags = (f"--hubble-tls-cert-file {cert} --hubble-tls-key-file {key} "
                     f"--hubble-tls-client-ca-files {bundle.ca_cert}")  # fmt: skip
        print(f"{name}: {flags}", file=out)
