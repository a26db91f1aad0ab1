"""Plumbing shared by Cilia services (DESIGN.md §5): no domain logic lives here."""

__version__ = "0.1.0"
