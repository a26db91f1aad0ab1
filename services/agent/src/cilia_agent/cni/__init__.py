"""The CNI configuration the agent installs for the container runtime, and the replay of
the plugin's DEL queue."""

from cilia_agent.cni.conflist import conflist_document, move_aside, uninstall, write_conflist

__all__ = ["conflist_document", "move_aside", "uninstall", "write_conflist"]
