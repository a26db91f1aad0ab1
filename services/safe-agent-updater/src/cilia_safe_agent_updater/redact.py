"""Keep credentials of ``--redis`` (and ``--docker-url``) out of log lines and messages.

A Redis URL may carry a password in its user info (``redis://USER:PASSWORD@HOST``, as
redis-py's ``from_url`` accepts it, percent-encoded or not) or as a ``password=`` query
argument. Everything the updater prints about such a URL goes through :func:`redact_url`
(the URL itself) or :func:`scrub` (any text, e.g. an exception message from redis-py that
might echo the URL or the password).
"""

from __future__ import annotations

import urllib.parse

MASK = "***"
"""What a password is replaced with."""

_SECRET_QUERY_KEYS = frozenset({"password"})


def _split(url: str) -> urllib.parse.SplitResult | None:
    try:
        return urllib.parse.urlsplit(url)
    except ValueError:  # e.g. an unbalanced '[' in the host
        return None


def secrets_of(url: str) -> list[str]:
    """Return the password strings of ``url`` (raw and percent-decoded), longest first.

    Covers the user-info password (``scheme://[USER]:PASSWORD@HOST``) and ``password=``
    query arguments. A URL that cannot be split at all yields its whole text after the
    first ``:`` of its user info when it has an ``@`` (best effort).
    """
    found: set[str] = set()
    parts = _split(url)
    if parts is None:
        _, sep, rest = url.partition("://")
        userinfo = rest.rpartition("@")[0] if sep else ""
        if ":" in userinfo:
            found.add(userinfo.partition(":")[2])
    else:
        userinfo = parts.netloc.rpartition("@")[0]
        if ":" in userinfo:
            found.add(userinfo.partition(":")[2])
        for pair in parts.query.split("&"):
            key, eq, value = pair.partition("=")
            if eq and urllib.parse.unquote_plus(key).lower() in _SECRET_QUERY_KEYS:
                found.add(value)
    decoded = {urllib.parse.unquote(s) for s in found} | {
        urllib.parse.unquote_plus(s) for s in found
    }
    return sorted((s for s in found | decoded if s), key=len, reverse=True)


def redact_url(url: str) -> str:
    """Return ``url`` with its password(s) replaced by ``***``; a URL without one unchanged.

    ``redis://admin:s3cr3t@127.0.0.1:6390/0`` → ``redis://admin:***@127.0.0.1:6390/0``;
    ``unix:///run/redis.sock?password=x&db=1`` → ``unix:///run/redis.sock?password=***&db=1``.
    """
    parts = _split(url)
    if parts is None:
        return _mask(url, secrets_of(url))
    if not secrets_of(url):
        return url
    netloc = parts.netloc
    userinfo, at, host = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:{MASK}@{host}"
    query = "&".join(
        f"{key}={MASK}"
        if eq and urllib.parse.unquote_plus(key).lower() in _SECRET_QUERY_KEYS
        else key + eq + value
        for key, eq, value in (pair.partition("=") for pair in parts.query.split("&"))
    )
    if "://" not in url:
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))
    # by hand: urlunsplit would turn unix:///path into unix:/path
    return (
        f"{parts.scheme}://{netloc}{parts.path}"
        + (f"?{query}" if query else "")
        + (f"#{parts.fragment}" if parts.fragment else "")
    )


def _mask(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, MASK)
    return text


def scrub(text: str, *urls: str) -> str:
    """Return ``text`` with every URL of ``urls`` redacted and each of their passwords masked.

    For exception messages of clients that were given the URL: the message may quote the
    URL, or the password alone (raw or percent-decoded).
    """
    for url in urls:
        if not url:
            continue
        secrets = secrets_of(url)
        if not secrets:
            continue
        text = _mask(text.replace(url, redact_url(url)), secrets)
    return text
