"""The command broker's protocol, run on its own class (no Ray): a command submitted and collected in one
call, results in rank order, a wait that ends with None and goes on, and a restarted rank fencing its command."""

import asyncio

from unirl_ray.runtime.broker import CommandBroker

Broker = CommandBroker.__ray_metadata__.modified_class  # the actor's Python class


def test_submit_and_collect_returns_every_ranks_result_in_rank_order() -> None:
    async def scenario():
        broker = Broker(2)
        gens = [await broker.announce(rank, {}) for rank in range(2)]

        async def rank(r: int, delay: float) -> None:
            cmd = await broker.next_command(r, 5.0)
            await asyncio.sleep(delay)
            await broker.post_result(r, gens[r], cmd["id"], {"rank": r, "op": cmd["op"], "payload": cmd["payload"]})

        workers = [asyncio.create_task(rank(1, 0.0)), asyncio.create_task(rank(0, 0.05))]
        cmd_id, results = await broker.submit_and_collect("ping", ["a", "b"], 5.0)
        await asyncio.gather(*workers)
        assert results == [{"rank": 0, "op": "ping", "payload": "a"}, {"rank": 1, "op": "ping", "payload": "b"}]
        assert cmd_id not in broker.pending and cmd_id not in broker.results  # forgotten once collected

        # not all in within the wait: None, and collect goes on waiting for the same command
        slow = [asyncio.create_task(rank(0, 0.3)), asyncio.create_task(rank(1, 0.0))]
        cmd_id, results = await broker.submit_and_collect("ping", ["c", "d"], 0.05)
        assert results is None and cmd_id in broker.pending
        results = await broker.collect(cmd_id, 5.0)
        await asyncio.gather(*slow)
        assert [r["payload"] for r in results] == ["c", "d"]

        # a rank that restarts while a command is pending answers it as fenced
        cmd_id, results = await broker.submit_and_collect("train", [1, 2], 0.01)
        assert results is None
        await broker.announce(0, {})
        await broker.post_result(1, gens[1], cmd_id, "done")
        assert await broker.collect(cmd_id, 5.0) == [{"fenced": True}, "done"]

    asyncio.run(scenario())
