"""ApplyFences: an apply asked about before it writes never writes; one writing is
waited for; an id is used once."""

from __future__ import annotations

import asyncio

import pytest

from cilia_operator.controlplane.applyfence import ApplyAbandoned, ApplyFences, Outcome
from cilia_operator.manifests import InvalidManifest


async def test_outcome_asked_before_writing_fences_the_apply() -> None:
    fences = ApplyFences()
    fence = fences.start("a", time_remaining=5.0)
    outcome, _ = await fences.outcome("a")
    assert outcome is Outcome.NOT_WRITTEN
    with pytest.raises(ApplyAbandoned):
        fences.begin_write(fence)
    assert not fence.writing


async def test_outcome_of_an_apply_writing_waits_for_its_end() -> None:
    fences = ApplyFences()
    fence = fences.start("b", time_remaining=None)
    fences.begin_write(fence)
    asked = asyncio.ensure_future(fences.outcome("b"))
    await asyncio.sleep(0.05)
    assert not asked.done()  # it waits: the commit may still land
    fences.finish(fence, Outcome.WRITTEN)
    assert (await asked)[0] is Outcome.WRITTEN
    assert (await fences.outcome("b"))[0] is Outcome.WRITTEN  # remembered


async def test_an_id_asked_about_before_its_apply_arrives_refuses_that_apply() -> None:
    fences = ApplyFences()
    assert (await fences.outcome("late"))[0] is Outcome.NOT_WRITTEN
    with pytest.raises(ApplyAbandoned):
        fences.start("late", time_remaining=5.0)


async def test_an_id_is_used_once_and_an_expired_deadline_refuses_to_write() -> None:
    fences = ApplyFences()
    done = fences.start("c", time_remaining=None)
    fences.finish(done, Outcome.NOT_WRITTEN)
    with pytest.raises(InvalidManifest, match="already used"):
        fences.start("c", time_remaining=None)
    expired = fences.start("d", time_remaining=0.0)
    with pytest.raises(ApplyAbandoned, match="deadline"):
        fences.begin_write(expired)
    with pytest.raises(InvalidManifest, match="request_id"):
        await fences.outcome("")


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError):
        ApplyFences(max_entries=0)
    with pytest.raises(ValueError):
        ApplyFences(retention=0)
