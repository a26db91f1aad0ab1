"""`apply` is one store transaction: concurrent overlapping pools, deadline-cut applies.

Against a real redis-server: many clients apply overlapping pools at once and the store
never holds two overlapping pools; an apply whose client deadline expires part-way over a
slow store leaves either every document or none of them.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import ipaddress
import json
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import grpc
from cluster import running_operator

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_operator.controlplane.resources import ResourceServicer, add_to_server
from cilia_operator.store import Write
from cilia_operator.store.redis import RedisStore

T = TypeVar("T")


def pool_yaml(name: str, cidr: str, mask: int = 28) -> str:
    return json.dumps(
        {
            "apiVersion": "cilium.io/v2alpha1",
            "kind": "CiliumPodIPPool",
            "metadata": {"name": name},
            "spec": {"ipv4": {"cidrs": [cidr], "maskSize": mask}},
        }
    )


async def stored_pools(channel: Any) -> dict[str, ipaddress.IPv4Network]:
    listed = await pb_grpc.ResourceServiceStub(channel).List(pb.ListRequest(kind="cpip"))
    out = {}
    for item in listed.items:
        obj = json.loads(item.json)
        for cidr in obj["spec"]["ipv4"]["cidrs"]:
            out[f"{obj['metadata']['name']}:{cidr}"] = ipaddress.IPv4Network(cidr)
    return out


async def test_concurrent_overlapping_pool_applies_at_most_one_succeeds_every_time(
    redis_url: str,
) -> None:
    """Property: 8 writers at once, each a pool overlapping all the others (a random
    prefix inside one /24 of a fresh /16 per round) -> exactly one succeeds, the others
    are refused naming the winner; and over all rounds no two stored pools overlap."""
    rng = random.Random(16)
    writers = 8
    async with running_operator(redis_url) as (_, channel):
        stub = pb_grpc.ResourceServiceStub(channel)
        for round_ in range(30):
            base = ipaddress.IPv4Network(f"10.{130 + round_}.7.0/24")
            cidrs = [
                str(rng.choice(list(base.subnets(new_prefix=rng.randint(24, 28)))[:1]))
                for _ in range(writers)
            ]  # every one contains 10.R.7.0: all overlap each other
            names = [f"r{round_}-w{i}" for i in range(writers)]

            async def one(name: str, cidr: str) -> grpc.StatusCode:
                try:
                    await stub.Apply(pb.ApplyRequest(manifest=pool_yaml(name, cidr)))
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() in (
                        grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.ABORTED,
                    ), exc.details()
                    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        assert "overlaps pool" in (exc.details() or "")
                    return exc.code()
                return grpc.StatusCode.OK

            codes = await asyncio.gather(*(one(n, c) for n, c in zip(names, cidrs, strict=True)))
            assert codes.count(grpc.StatusCode.OK) == 1, (round_, cidrs, codes)
        pools = list((await stored_pools(channel)).items())
        assert len(pools) == 30 + 1  # one per round and the auto-created default
        for i, (a, net_a) in enumerate(pools):
            for b, net_b in pools[:i]:
                assert not net_a.overlaps(net_b), (a, b)


async def test_concurrent_transactions_on_the_store_never_both_commit(redis_url: str) -> None:
    """Store level: writers that each create a record only if none exists; 20 at once ->
    exactly one record, the others see it on their retry."""
    stores = [RedisStore(redis_url) for _ in range(20)]
    try:

        async def writer(store: RedisStore, i: int) -> bool:
            async def plan(snapshot: Any) -> list[Write]:
                if snapshot["Thing"].items:
                    return []
                return [Write("create", {"kind": "Thing", "metadata": {"name": f"t{i}"}})]

            return bool(await store.transact(["Thing"], plan, attempts=30))

        wins = await asyncio.gather(*(writer(s, i) for i, s in enumerate(stores)))
        assert wins.count(True) == 1
        assert len((await stores[0].list("Thing")).items) == 1
    finally:
        for store in stores:
            await store.close()


class SlowRedisStore(RedisStore):
    """A RedisStore whose every round trip to Redis takes ``delay`` seconds longer: a
    store on a slow link. Fault injection only: a local redis-server answers too fast
    for a client deadline to land between two writes."""

    delay = 0.03
    slow_gets = True

    async def _call(self, pending: Any) -> Any:
        if self.slow_gets or not _getting.get():
            try:
                await asyncio.sleep(self.delay)
            except BaseException:  # cancelled (deadline): the call was never sent
                if inspect.iscoroutine(pending):
                    pending.close()
                raise
        return await super()._call(pending)

    async def get(self, kind: str, name: str, namespace: str = "") -> Any:
        token = _getting.set(True)
        try:
            return await super().get(kind, name, namespace)
        finally:
            _getting.reset(token)


_getting: contextvars.ContextVar[bool] = contextvars.ContextVar("getting", default=False)


@asynccontextmanager
async def resource_server(store: RedisStore) -> AsyncIterator[Any]:
    server = grpc.aio.server()
    add_to_server(ResourceServicer(store), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    channel.address = f"127.0.0.1:{port}"  # type: ignore[attr-defined]
    try:
        yield channel
    finally:
        await channel.close()
        await server.stop(0)


async def test_apply_cut_by_its_deadline_leaves_all_documents_or_none(redis_url: str) -> None:
    """20 pools in one manifest over a slow store, deadlines from 20 ms to 1.2 s: after
    each apply (failed or not) the store holds 0 or 20 of them, never some."""
    docs = 20
    manifest = "\n---\n".join(pool_yaml(f"p{i}", f"10.60.{i}.0/24", 26) for i in range(docs))
    store = SlowRedisStore(redis_url)
    plain = RedisStore(redis_url)
    outcomes: list[tuple[float, str, int]] = []
    try:
        async with resource_server(store) as channel:
            stub = pb_grpc.ResourceServiceStub(channel)
            for step in range(25):
                deadline = 0.02 + step * 0.05
                try:
                    await stub.Apply(pb.ApplyRequest(manifest=manifest), timeout=deadline)
                    code = "OK"
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc.details()
                    code = exc.code().name
                await asyncio.sleep(0.5)  # a handler not cancelled would finish meanwhile
                held = (await plain.list("CiliumPodIPPool")).items
                outcomes.append((deadline, code, len(held)))
                assert len(held) in (0, docs), outcomes
                for obj in held:
                    await plain.delete("CiliumPodIPPool", obj["metadata"]["name"])
        codes = {code for _, code, _ in outcomes}
        assert codes == {"OK", "DEADLINE_EXCEEDED"}, outcomes  # both sides were exercised
        assert any(code != "OK" and n == 0 for _, code, n in outcomes), outcomes
    finally:
        await store.close()
        await plain.close()


async def test_cli_says_whether_a_deadline_cut_apply_was_written(redis_url: str) -> None:
    """`cilia-operator apply` whose --timeout expires: the CLI asks ApplyOutcome and says
    "confirmed after the deadline" exactly when all are stored, else "nothing was written"
    exactly when none is and none will be (exit 2)."""
    from cilia_operator import cli

    docs = 12
    manifest = "\n---\n".join(pool_yaml(f"c{i}", f"10.61.{i}.0/24", 26) for i in range(docs))
    store = SlowRedisStore(redis_url)
    store.slow_gets = False  # the CLI's read-back after the deadline answers in time
    plain = RedisStore(redis_url)
    said: set[str] = set()
    try:
        async with resource_server(store) as channel:
            target = channel.address
            for step in range(16):
                timeout = 0.02 + step * 0.04

                def run(timeout: float = timeout) -> str:
                    import io
                    import os
                    import tempfile

                    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
                        f.write(manifest)
                    buf = io.StringIO()
                    try:
                        cli.apply(f.name, target, False, timeout, buf)
                        return "ok:" + buf.getvalue()
                    except cli.CommandError as exc:
                        return "error:" + str(exc)
                    finally:
                        os.unlink(f.name)

                result = await asyncio.to_thread(run)
                held = len((await plain.list("CiliumPodIPPool")).items)
                if result.startswith("ok:") and "confirmed after the deadline" in result:
                    said.add("all")
                    assert held == docs, result
                elif result.startswith("ok:"):
                    said.add("ok")
                    assert held == docs and result.count("created") == docs, result
                else:
                    said.add("none")
                    assert "nothing was written" in result, result
                    assert held == 0, result
                    await asyncio.sleep(0.3)  # the fenced apply must not write later
                    assert len((await plain.list("CiliumPodIPPool")).items) == 0, result
                for obj in (await plain.list("CiliumPodIPPool")).items:
                    await plain.delete("CiliumPodIPPool", obj["metadata"]["name"])
        assert "none" in said and "ok" in said, said
    finally:
        await store.close()
        await plain.close()
