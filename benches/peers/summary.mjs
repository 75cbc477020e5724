// The medians, ranges and run counts of what benches/peers/run.sh collected: rowq's JSON lines
// (its floors and in-memory pipeline) and each peer's (lines with a "peer" field), as a table on
// stderr; and the same as one JSON line on stdout. An error if any side has no runs.
//
//   node summary.mjs FILE [PEER...]
import { readFileSync } from "node:fs";

const lines = readFileSync(process.argv[2], "utf8")
  .split("\n")
  .filter((line) => line.startsWith("{"))
  .map((line) => JSON.parse(line));
// The peers named after FILE, each of which must have runs; or every peer FILE holds.
const named = process.argv.slice(3);
const peers = named.length > 0 ? named : [...new Set(lines.filter((l) => l.peer).map((l) => l.peer))].sort();
if (peers.length === 0) throw new Error(`${process.argv[2]} holds no peer's runs`);

const floor = (l) => l.workload === "latency-floor";
// The two-step floor's clock (its fenced start), unless rowq's side ran with BENCH_FLOOR_STEPS=1.
const twoStep = lines.some((l) => floor(l) && l.started_p50_ms !== undefined);
const rowqPickup = (l) => l.workload === "latency" && l.transport === "memory";
const rowqDrain = (l) => l.workload === "drain" && l.transport === "memory";
const peerPickup = (peer) => (l) => l.peer === peer && l.workload === "latency";
const peerDrain = (peer, config) => (l) => l.peer === peer && l.config === config;

// (what, which lines, which number of each): the pickup's p50 and p99 (`q`), each side's; the
// drain's rate and CPU per job (`key`, `unit`), rowq's and each peer's with its two settings.
const pickup = (q) => [
  [`pickup ${q}, ms: latency floor`, floor, (l) => l[`${q}_ms`]],
  ...(twoStep ? [[`pickup ${q}, ms: two-step latency floor (its start)`, floor, (l) => l[`started_${q}_ms`]]] : []),
  [`pickup ${q}, ms: rowq in memory, started_at (its fence)`, rowqPickup, (l) => l[`${q}_ms`]],
  ...peers.flatMap((peer) => [
    [`pickup ${q}, ms: ${peer}, claimed (its claim's now())`, peerPickup(peer), (l) => l[`${q}_ms`]],
    [`pickup ${q}, ms: ${peer}, task called`, peerPickup(peer), (l) => l.handler[`${q}_ms`]],
  ]),
];
const drain = (unit, key) => [
  [`drain, ${unit}: rowq in memory`, rowqDrain, (l) => l[key]],
  ...peers.flatMap((peer) => [
    [`drain, ${unit}: ${peer}, defaults`, peerDrain(peer, "drain"), (l) => l[key]],
    [`drain, ${unit}: ${peer}, batched`, peerDrain(peer, "drain-batched"), (l) => l[key]],
  ]),
];
const rows = [
  ...pickup("p50"),
  ...pickup("p99"),
  ["drain, rows/s: sql-floor", (l) => l.workload === "sql-floor", (l) => l.rows_per_s],
  ...drain("jobs/s", "jobs_per_s"),
  ...drain("machine CPU µs/job", "cpu_us_per_job"),
];

const median = (sorted) => sorted[Math.floor((sorted.length - 1) / 2)];
const width = Math.max(...rows.map(([what]) => what.length));
const summary = {};
for (const [what, test, value] of rows) {
  const values = lines
    .filter(test)
    .map(value)
    .sort((a, b) => a - b);
  if (values.length === 0) throw new Error(`${process.argv[2]} holds no runs for "${what}"`);
  summary[what] = { median: median(values), min: values[0], max: values[values.length - 1], runs: values.length };
  const { min, max, runs } = summary[what];
  console.error(`${what.padEnd(width)}  median ${median(values)}  (${min}–${max}, ${runs} runs)`);
}
console.log(JSON.stringify({ workload: "peers-summary", ...summary }));
