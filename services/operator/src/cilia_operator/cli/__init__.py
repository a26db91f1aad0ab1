"""Client commands: ``apply``, ``get``, ``delete`` and ``ipam plan|status`` against a
running operator (plaintext, or mutual TLS with ``--tls-operator-*`` files), and
``certs generate`` (the standalone control plane's certificates).

Each returns the process exit status: 0 on success; on failure one line on stderr and
status 2 (bad input, not found, refused) -- never a traceback.
"""

from .certs import certs_generate
from .connection import EXIT_ERROR, SERVER_FORM, CommandError, channel, check_server
from .ipam import DEFAULT_SERVICE_CIDR, draining_lines, ipam_plan, ipam_status
from .resources import apply, delete, delete_many, get
from .servicecidr import servicecidr_migrate, servicecidr_status
from .servicecidr_k8s_cmd import servicecidr_migrate_k8s, servicecidr_status_k8s

__all__ = [
    "DEFAULT_SERVICE_CIDR",
    "EXIT_ERROR",
    "SERVER_FORM",
    "CommandError",
    "apply",
    "certs_generate",
    "channel",
    "check_server",
    "delete",
    "delete_many",
    "draining_lines",
    "get",
    "ipam_plan",
    "ipam_status",
    "servicecidr_migrate",
    "servicecidr_migrate_k8s",
    "servicecidr_status",
    "servicecidr_status_k8s",
]
