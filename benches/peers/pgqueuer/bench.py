"""PgQueuer (https://github.com/janbjorge/pgqueuer), a Postgres job queue for Python's asyncio,
measured the way rowq's benchmark measures rowq, on the same Postgres: `make bench-peers` runs it
in turns with rowq's floors and pipeline (benches/peers/run.sh). One JSON line per workload.

Settings, with the defaults of rowq's `make bench`: DATABASE_URL, BENCH_N (drain backlog, 20000),
BENCH_LATENCY_N (measured pickups, 1000), BENCH_RATE (inserts per second, 100); PEER_ONLY (the
workloads: latency, drain, drain-batched).
"""

import asyncio
import contextlib
import json
import os
import time
from datetime import timedelta
from typing import Self
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import uvloop
from pgqueuer import AsyncpgDriver, Job, Queries, QueueManager
from pgqueuer.types import QueueExecutionMode

PEER = "pgqueuer"
URL = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
ONLY = os.environ.get("PEER_ONLY", "latency,drain,drain-batched").split(",")
N = int(os.environ.get("BENCH_N", "20000"))
LATENCY_N = int(os.environ.get("BENCH_LATENCY_N", "1000"))
RATE = float(os.environ.get("BENCH_RATE", "100"))
# Jobs trickled before the measured ones and left out, as in rowq's bench (WARM_UP_JOBS).
WARM_UP = 20
# The log of status changes is folded into statistics on a timer by default; off, so that the
# workloads measure the queue alone.
NO_FOLDING = timedelta(0)


class Database:
    """A database of its own with PgQueuer's schema, and a connection to it for the workload."""

    def __init__(self, label: str):
        self.name = f"rowq_peer_pgqueuer_{label}_{os.getpid()}"
        parts = urlsplit(URL)
        self.url = urlunsplit(parts._replace(path=f"/{self.name}"))
        self.connections: list[asyncpg.Connection] = []

    async def __aenter__(self) -> Self:
        admin = await asyncpg.connect(URL)
        try:
            await admin.execute(f"CREATE DATABASE {self.name}")
        finally:
            await admin.close()
        try:
            self.client = await asyncpg.connect(self.url)
            self.queries = Queries(AsyncpgDriver(self.client))
            await self.queries.install()
        except BaseException:
            await self._drop()
            raise
        return self

    async def worker(self) -> QueueManager:
        """A queue manager on a connection of its own, closed on exit."""
        connection = await asyncpg.connect(self.url)
        self.connections.append(connection)
        return QueueManager(Queries(AsyncpgDriver(connection)))

    async def __aexit__(self, *_) -> None:
        for connection in self.connections:
            await connection.close()
        await self.client.close()
        await self._drop()

    async def _drop(self) -> None:
        admin = await asyncpg.connect(URL)
        try:
            await admin.execute(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)")
        finally:
            await admin.close()


def percentiles(values: list[float]) -> dict[str, float]:
    ms = sorted(values)

    def at(q: float) -> float:
        return round(ms[min(len(ms) - 1, int(q * len(ms)))], 3)

    return {"p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": round(ms[-1], 3)}


def machine_seconds() -> float:
    """The whole machine's busy CPU seconds, as rowq's bench counts them (CpuMeter)."""
    with open("/proc/stat") as stat:
        fields = [float(f) for f in stat.readline().split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / 100


async def latency() -> dict:
    """Jobs enqueued one per transaction at BENCH_RATE while the worker is idle. Two spans per
    job from the insert's now() (`created`): to the claim's now() (`updated`, set by the dequeue
    statement; what the floor's started_at is) and to the moment the entrypoint is called (by
    the wall clock, which Postgres's now() reads too)."""
    async with Database("latency") as db:
        qm = await db.worker()
        spans: list[tuple[float, float]] = []
        total = WARM_UP + LATENCY_N
        all_ran = asyncio.Event()

        @qm.entrypoint("noop")
        async def noop(job: Job) -> None:
            called = time.time()
            spans.append(
                ((job.updated - job.created).total_seconds() * 1000, (called - job.created.timestamp()) * 1000)
            )
            if len(spans) >= total:
                all_ran.set()

        running = asyncio.create_task(qm.run(log_aggregation_interval=NO_FOLDING))
        await asyncio.sleep(0.3)
        start = time.perf_counter()
        for i in range(total):
            wait = start + i / RATE - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            await db.queries.enqueue("noop", None)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_ran.wait(), 60)
        qm.shutdown.set()
        await running
        if len(spans) < total:
            raise SystemExit(f"{PEER}: {total - len(spans)} of {total} jobs never ran")
        measured = spans[WARM_UP:]
        claimed = percentiles([claim for claim, _ in measured])
        handler = percentiles([call for _, call in measured])
        # The entrypoint is called after its claim, so a wall clock read off Postgres's shows
        # as an entrypoint called before its claim.
        if handler["p50_ms"] < claimed["p50_ms"]:
            raise SystemExit(f"{PEER}: the wall clock disagrees with Postgres's")
        return {"workload": "latency", "peer": PEER, "jobs": LATENCY_N, **claimed, "handler": handler}


async def drain(config: str, batch_size: int) -> dict:
    """BENCH_N no-op jobs pre-inserted; a queue manager started in drain mode, timed until it
    returns (every job run and its completion written), as rowq's drain is timed from its
    pipeline's start."""
    async with Database(config.replace("-", "_")) as db:
        for done in range(0, N, 1000):
            n = min(1000, N - done)
            await db.queries.enqueue(["noop"] * n, [None] * n, [0] * n)
        qm = await db.worker()
        ran = 0

        @qm.entrypoint("noop")
        async def noop(job: Job) -> None:
            nonlocal ran
            ran += 1

        start, machine, own = time.perf_counter(), machine_seconds(), time.process_time()
        await qm.run(batch_size=batch_size, mode=QueueExecutionMode.drain, log_aggregation_interval=NO_FOLDING)
        seconds = time.perf_counter() - start
        cpu = round((machine_seconds() - machine) * 1e6 / N)
        client_cpu = round((time.process_time() - own) * 1e6 / N)
        left = await db.client.fetchval("SELECT count(*) FROM pgqueuer")
        if ran != N or left != 0:
            raise SystemExit(f"{PEER}: {ran} of {N} jobs ran, {left} left in the queue")
        return {
            "workload": "drain",
            "peer": PEER,
            "config": config,
            "batch_size": batch_size,
            "jobs": N,
            "jobs_per_s": round(N / seconds),
            "cpu_us_per_job": cpu,
            "client_cpu_us_per_job": client_cpu,
        }


async def main() -> None:
    # The defaults (a dequeue fetches 10 jobs), and ten times that per dequeue.
    workloads = {
        "latency": latency,
        "drain": lambda: drain("drain", 10),
        "drain-batched": lambda: drain("drain-batched", 100),
    }
    for name in ONLY:
        if name not in workloads:
            raise SystemExit(f"PEER_ONLY: no workload {name!r} ({', '.join(workloads)})")
        print(json.dumps(await workloads[name]()), flush=True)


if __name__ == "__main__":
    uvloop.run(main())
