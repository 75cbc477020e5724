// Graphile Worker (https://worker.graphile.org), a Postgres job queue for Node.js, measured the
// way rowq's benchmark measures rowq, on the same Postgres: `make bench-peers` runs it in turns
// with rowq's floors and pipeline (benches/peers/run.sh). One JSON line per workload on stdout.
//
// PEER_ONLY (the workloads: latency, drain, drain-batched), DATABASE_URL (a server whose user
// may create databases), BENCH_N (drain backlog, 20000), BENCH_LATENCY_N (measured pickups,
// 1000), BENCH_RATE (inserts per second, 100), BENCH_C (jobs run at once, 8): the same settings,
// with the same defaults, as rowq's `make bench`.
import { readFileSync } from "node:fs";
import { cpuUsage } from "node:process";
import { performance } from "node:perf_hooks";
import pg from "pg";
import { Logger, run, runMigrations } from "graphile-worker";

const PEER = "graphile-worker";
const settings = {
  url: process.env.DATABASE_URL ?? "postgres://postgres@127.0.0.1:5432/test",
  only: (process.env.PEER_ONLY ?? "latency,drain,drain-batched").split(","),
  n: Number(process.env.BENCH_N ?? 20000),
  latencyN: Number(process.env.BENCH_LATENCY_N ?? 1000),
  rate: Number(process.env.BENCH_RATE ?? 100),
  c: Number(process.env.BENCH_C ?? 8),
};
// Jobs trickled before the measured ones and left out, as in rowq's bench (WARM_UP_JOBS).
const WARM_UP = 20;
const silent = new Logger(() => () => {});
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
// The clock Postgres's now() reads (the wall clock), in ms with its microseconds.
const wallMs = () => performance.timeOrigin + performance.now();

// The whole machine's busy CPU seconds (every field of /proc/stat's first line but idle and
// iowait, at 100 ticks a second), as rowq's bench counts it (CpuMeter).
function machineSeconds() {
  const fields = readFileSync("/proc/stat", "utf8").split("\n")[0].trim().split(/\s+/).slice(1, 9).map(Number);
  return (fields.reduce((a, b) => a + b, 0) - fields[3] - fields[4]) / 100;
}

// Runs `f` with a database of its own, holding Graphile Worker's schema: `f` gets a client and
// the pool Graphile Worker is to use. Drops the database afterwards, whether `f` succeeded or not.
async function withDatabase(label, f) {
  const name = `rowq_peer_graphile_${label}_${process.pid}`;
  await admin((client) => client.query(`CREATE DATABASE ${name}`));
  try {
    const url = new URL(settings.url);
    url.pathname = `/${name}`;
    // Graphile Worker's own pool would outlive its runner's stop() by a moment, and the drop
    // would then terminate an idle connection that nothing listens to errors on. This one is
    // ended before the drop; after a failure, the drop may terminate its connections.
    const pool = new pg.Pool({ connectionString: url.toString(), max: settings.c + 2 });
    pool.on("error", () => {});
    pool.on("connect", (client) => client.on("error", () => {}));
    await runMigrations({ pgPool: pool, logger: silent });
    const client = new pg.Client({ connectionString: url.toString() });
    await client.connect();
    try {
      const result = await f({ pool, client });
      await pool.end();
      return result;
    } finally {
      await client.end();
    }
  } finally {
    await admin((client) => client.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`));
  }
}

async function admin(f) {
  const client = new pg.Client({ connectionString: settings.url });
  await client.connect();
  try {
    return await f(client);
  } finally {
    await client.end();
  }
}

function percentiles(values) {
  const ms = [...values].sort((a, b) => a - b);
  const at = (q) => ms[Math.min(ms.length - 1, Math.floor(q * ms.length))];
  const round = (v) => Math.round(v * 1000) / 1000;
  return { p50_ms: round(at(0.5)), p99_ms: round(at(0.99)), max_ms: round(ms[ms.length - 1]) };
}

// Waits until `done()` or `seconds` pass; an error naming `what` if it never was.
async function until(done, seconds, what) {
  const deadline = performance.now() + seconds * 1000;
  while (!(await done())) {
    if (performance.now() > deadline) throw new Error(`${PEER}: ${what} after ${seconds} s`);
    await sleep(1);
  }
}

// Pickup latency: a client inserts jobs one per transaction at BENCH_RATE while the workers are
// idle. Two spans per job, both from the insert's now() (its transaction's start, as rowq's
// created_at): to the claim's now() (`locked_at`, what the floor's started_at is), and to the
// moment the task function is called (by the wall clock, in microseconds). rowq's started_at
// is its fence's now(), which comes between the two: after its claim, before its handler.
async function latency(db) {
  // The job row goes when the job completes, and a pg client reads timestamps to the ms, so a
  // trigger keeps each claim's locked_at. It runs inside the claim, after the claim's now().
  await db.client.query(`
    CREATE TABLE public.claims (job_id bigint, created_at timestamptz, locked_at timestamptz);
    CREATE FUNCTION public.keep_claim() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
      INSERT INTO public.claims VALUES (NEW.id, NEW.created_at, NEW.locked_at);
      RETURN NEW;
    END $$;
    CREATE TRIGGER keep_claim AFTER UPDATE OF locked_at ON graphile_worker._private_jobs
      FOR EACH ROW WHEN (OLD.locked_at IS NULL AND NEW.locked_at IS NOT NULL)
      EXECUTE FUNCTION public.keep_claim();
  `);
  const called = [];
  const runner = await run({
    pgPool: db.pool,
    concurrency: settings.c,
    noHandleSignals: true,
    logger: silent,
    taskList: { noop: async (payload) => void called.push(wallMs() - payload.inserted_ms) },
  });
  await sleep(300);
  const insert =
    "SELECT graphile_worker.add_job('noop', json_build_object('inserted_ms', extract(epoch FROM now()) * 1000))";
  const total = WARM_UP + settings.latencyN;
  const start = performance.now();
  for (let i = 0; i < total; i++) {
    const wait = start + (i * 1000) / settings.rate - performance.now();
    if (wait > 0) await sleep(wait);
    await db.client.query(insert);
  }
  await until(() => called.length >= total, 60, `${total - called.length} of ${total} jobs never ran`);
  await runner.stop();
  const { rows } = await db.client.query(
    `SELECT extract(epoch FROM locked_at - created_at)::float8 * 1000 AS ms
     FROM public.claims ORDER BY job_id OFFSET $1`,
    [WARM_UP],
  );
  if (rows.length !== settings.latencyN) {
    throw new Error(`${PEER}: ${rows.length} claims kept, not ${settings.latencyN}`);
  }
  const claimed = percentiles(rows.map((row) => row.ms));
  const handler = percentiles(called.slice(WARM_UP));
  // The task is called after its claim, so a wall clock read off Postgres's shows as a handler
  // that starts before its claim.
  if (handler.p50_ms < claimed.p50_ms) throw new Error(`${PEER}: the wall clock disagrees with Postgres's`);
  return { workload: "latency", peer: PEER, jobs: settings.latencyN, ...claimed, handler };
}

// Drain: BENCH_N no-op jobs in one transaction while the workers are idle; timed from its
// commit until every job has run and been completed (Graphile Worker deletes a completed job).
// The workers are running before the clock starts, which favours the peer over rowq's drain,
// whose clock starts before its pipeline does.
async function drain(db, config, preset) {
  let ran = 0;
  const runner = await run({
    pgPool: db.pool,
    concurrency: settings.c,
    noHandleSignals: true,
    logger: silent,
    preset,
    taskList: { noop: async () => void ran++ },
  });
  await sleep(300);
  await db.client.query(
    `SELECT graphile_worker.add_jobs(array(
       SELECT ROW('noop', '{}'::json, null, null, null, null, null, null)::graphile_worker.job_spec
       FROM generate_series(1, $1)))`,
    [settings.n],
  );
  const [start, machine, own] = [performance.now(), machineSeconds(), cpuUsage()];
  await until(() => ran >= settings.n, 600, `${settings.n - ran} of ${settings.n} jobs never ran`);
  const count = "SELECT count(*)::int AS n FROM graphile_worker._private_jobs";
  const left = async () => (await db.client.query(count)).rows[0].n;
  await until(async () => (await left()) === 0, 60, "jobs ran but were never completed");
  const seconds = (performance.now() - start) / 1000;
  const perJob = (cpuSeconds) => Math.round((cpuSeconds * 1e6) / settings.n);
  const cpu = perJob(machineSeconds() - machine);
  const used = cpuUsage(own);
  const clientCpu = perJob((used.user + used.system) / 1e6);
  await runner.stop();
  return {
    workload: "drain",
    peer: PEER,
    config,
    jobs: settings.n,
    jobs_per_s: Math.round(settings.n / seconds),
    cpu_us_per_job: cpu,
    client_cpu_us_per_job: clientCpu,
  };
}

// Graphile Worker's documented batching (https://worker.graphile.org/docs/performance): the pool
// locks up to 500 jobs per fetch, and completions are batched. Its docs name the trade: jobs
// locked in one process's local queue wait there, and a crash before a batch of completions is
// written runs those jobs again after the lock times out (4 hours).
const BATCHED = { worker: { localQueue: { size: 500 }, completeJobBatchDelay: 0, failJobBatchDelay: 0 } };

const workloads = {
  latency,
  drain: (db) => drain(db, "drain"),
  "drain-batched": (db) => drain(db, "drain-batched", BATCHED),
};
for (const name of settings.only) {
  if (!workloads[name]) throw new Error(`PEER_ONLY: no workload "${name}" (${Object.keys(workloads).join(", ")})`);
  console.log(JSON.stringify(await withDatabase(name.replace("-", "_"), workloads[name])));
}
