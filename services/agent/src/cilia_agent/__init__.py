"""Cilia node agent: endpoints, node-local IPAM and pod plumbing (DESIGN.md §2-§4)."""

__version__ = "0.1.0"
