"""The agent's demand formula (upstream ``neededIPCeil``)."""

from __future__ import annotations


def needed_ip_ceil(n: int, pre_alloc: int) -> int:
    """Return how many addresses to request for ``n`` in-use + pending addresses.

    With ``pre_alloc`` 0 the demand is exactly ``n``. Otherwise, with
    ``q = n // pre_alloc``, it is ``(q + 2) * pre_alloc`` when ``n`` is not a
    multiple of ``pre_alloc`` and ``(q + 1) * pre_alloc`` when it is, so a full
    buffer of ``pre_alloc`` free addresses always stays available.
    Examples with ``pre_alloc=8``: 0→8, 3→16, 8→16, 9→24, 17→32.

    Raises:
        ValueError: ``n`` or ``pre_alloc`` is negative.

    Source: upstream ``pkg/ipam/multipool.go`` ``neededIPCeil``
    (reference: cilium-upstream.md §1, txtar values 3→16, 9→24, 17→32).
    """
    if n < 0 or pre_alloc < 0:
        raise ValueError(f"needed_ip_ceil: n={n} and pre_alloc={pre_alloc} must be >= 0")
    if pre_alloc == 0:
        return n
    q, rem = divmod(n, pre_alloc)
    return (q + 2) * pre_alloc if rem else (q + 1) * pre_alloc
