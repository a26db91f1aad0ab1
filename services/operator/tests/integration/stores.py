"""Store backends for the shared suite: a real redis-server and the mock Kubernetes API.

``make_store`` is a fixture factory: test modules do ``from stores import make_store``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from cilia_kubemock import KubeMock, ResourceType
from cilia_operator.store import Store
from cilia_operator.store.kubernetes import KubeKind, KubernetesStore
from cilia_operator.store.redis import RedisStore

# Test-only kinds of the shared suite, served by the mock like any CRD.
TEST_KINDS = {
    "Thing": KubeKind("test.cilia.io", "v1", "things", False),
    "Other": KubeKind("test.cilia.io", "v1", "others", False),
    "Scoped": KubeKind("test.cilia.io", "v1", "scopeds", True),
    "Statusful": KubeKind("test.cilia.io", "v1", "statusfuls", False, status_subresource=True),
}

StoreFactory = Callable[..., Store]


def start_kubemock(**kwargs: Any) -> KubeMock:
    """A started KubeMock that also serves TEST_KINDS."""
    mock = KubeMock(**kwargs)
    for kind, info in TEST_KINDS.items():
        mock.add_type(
            ResourceType(
                info.group, info.version, info.plural, kind.lower(), kind, info.namespaced,
                status_subresource=info.status_subresource,
            )
        )  # fmt: skip
    mock.start()
    return mock


def kube_store(mock: KubeMock, **kwargs: Any) -> KubernetesStore:
    """A KubernetesStore on ``mock``; 1 s watch requests, so every watch test also
    exercises the reconnect from the last seen version."""
    from kubernetes.aio import client

    cfg = client.Configuration()
    cfg.host = mock.url
    kwargs.setdefault("watch_timeout", 1)
    return KubernetesStore(configuration=cfg, kinds=TEST_KINDS, **kwargs)


@pytest.fixture(params=["redis", "kubernetes"])
def make_store(request: pytest.FixtureRequest) -> Iterator[StoreFactory]:
    """``make_store(event_history=N)`` -> a fresh, empty Store on the parametrized backend.

    Stores are not closed by the fixture (the test closes them on its own event loop).
    """
    mocks: list[KubeMock] = []
    if request.param == "redis":
        url = request.getfixturevalue("redis_server")
        redis.Redis.from_url(url).flushall()

        def make_redis(event_history: int = 10000) -> Store:
            return RedisStore(url, event_history=event_history, watch_block_timeout=0.5)

        yield make_redis
    else:

        def make_kube(event_history: int = 10000) -> Store:
            if not mocks:
                mocks.append(start_kubemock(event_history=event_history))
            return kube_store(mocks[0])

        yield make_kube
    for mock in mocks:
        mock.stop()
