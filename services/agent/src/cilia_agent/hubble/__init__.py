"""Agent-side Hubble: datapath events → enriched flows → ring → Observer/Peer gRPC.

Entry point for the agent: :class:`cilia_agent.hubble.service.Hubble` (see its module
docstring for the wiring). Layers, importing only downward::

    events  (struct flow_event bytes → FlowEvent)
    enrich  (Resolver protocol, MemoryResolver)
    parser  (FlowEvent → flow.Flow)
    ring, filters, eventlog (agent/debug events, namespaces seen)
    observer (FlowStore + observer.Observer), peer (PeerRegistry + peer.Peer), metrics
    reader  (libbpf ring buffer → parser → FlowStore)
    service (Hubble: everything wired)
"""
