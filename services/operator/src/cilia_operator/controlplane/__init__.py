"""gRPC servicers of ``cilia.controlplane.v1`` (NodeService, IPAMService, ResourceService)."""
