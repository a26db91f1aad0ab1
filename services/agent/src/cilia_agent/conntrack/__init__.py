"""Connection tracking owned by the agent: the garbage collector of ``cilia_ct`` (``gc``)."""
