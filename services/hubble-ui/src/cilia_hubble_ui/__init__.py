"""cilia-hubble-ui: Hubble UI's live service map, served by its own small service.

It dials the relay's ``observer.Observer`` (the versioned Hubble contract in ``proto/``),
keeps one ``GetFlows --follow`` stream per open page with that page's filters as the
request's whitelist, and pushes the page a graph (namespaces, pods/identities, flows as
forwarded/dropped edges) and a flow table over server-sent events. Layers (imports only go
down): ``__main__`` → ``app`` → ``web`` → ``relay`` → ``graph`` | ``filters`` → ``config``.
"""

__version__ = "0.1.0"
