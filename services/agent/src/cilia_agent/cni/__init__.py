"""The CNI configuration the agent installs for the container runtime."""

from cilia_agent.cni.conflist import conflist_document, write_conflist

__all__ = ["conflist_document", "write_conflist"]
