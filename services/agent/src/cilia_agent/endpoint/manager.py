"""The endpoint manager: the node's endpoints and their whole lifecycle, in one object.

:class:`EndpointManager` assembles the parts, each in a module of its own: the table of
records, locks and state files (:mod:`.table`), Add (:mod:`.add`, chained Adds
:mod:`.chained`), Del (:mod:`.delete`), Check (:mod:`.check`), restore and GC
(:mod:`.restore`), relabel and gateway moves (:mod:`.update`); the requests and their
validation are in :mod:`.params`, what the parts need of other layers in :mod:`.protocols`.
"""

from __future__ import annotations

from cilia_agent.endpoint.add import EndpointAdds
from cilia_agent.endpoint.check import EndpointChecks
from cilia_agent.endpoint.params import AddParams, CheckParams
from cilia_agent.endpoint.restore import EndpointRestore, RestoreReport
from cilia_agent.endpoint.update import EndpointUpdates

__all__ = ["AddParams", "CheckParams", "EndpointManager", "RestoreReport"]


class EndpointManager(EndpointAdds, EndpointChecks, EndpointRestore, EndpointUpdates):
    """Holds the node's endpoints and drives their lifecycle (Add, Del, Check, GC, restore,
    relabel, gateway moves).

    Built with the keyword arguments of :class:`~cilia_agent.endpoint.table.EndpointTable`
    (the allocator, datapath, state store, metrics, worker pool, default MTU, node view, and
    the optional pool selector, change callback, enforcement hooks and pod cache).
    """
