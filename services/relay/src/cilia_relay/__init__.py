"""cilia-relay: Hubble relay (fans ``observer.Observer`` out to every agent).

``serve`` learns agents through ``peer.Peer/Notify``, keeps one channel per agent and
serves a merged, time-ordered ``observer.Observer`` (GetFlows, ServerStatus, GetNodes);
``observe`` is a ``hubble observe``-like client. Layers (imports only go down):
``__main__`` → ``app`` → ``observer`` → ``peers``/``merge`` → ``config``; ``cli`` is the
client side and shares only ``config``'s address helpers.
"""

__version__ = "0.1.0"
