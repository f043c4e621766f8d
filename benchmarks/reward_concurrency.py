"""How long a rollout batch waits for slow Python reward functions: ppojax's concurrent calls against calling the
same functions one after another (and each per-sample function row by row), as a plain loop would.

The functions sleep (a remote verifier, a sandboxed test run); the batch is 32 rows. Prints one JSON object:
the wall seconds of each way and the sum of the functions' own latencies.

    python -m benchmarks.reward_concurrency --json out.json
"""
import argparse
import asyncio
import json
import time

from ppojax.rl.reward_calls import RewardBatch, RewardCall, call_all

ROWS = 32
BATCH_SLEEP = 0.2  # a batched function's latency per call
ROW_SLEEP = 0.05  # a per-sample function's latency per row


def checker_a(completions, **kwargs):
    time.sleep(BATCH_SLEEP)
    return [1.0] * len(completions)


def checker_b(completions, **kwargs):
    time.sleep(BATCH_SLEEP)
    return [0.0] * len(completions)


async def remote_judge(prompts, completions):
    await asyncio.sleep(BATCH_SLEEP)
    return [0.5] * len(completions)


async def remote_per_sample(completion):
    await asyncio.sleep(ROW_SLEEP)
    return 1.0


FUNCTIONS = (checker_a, checker_b, remote_judge, remote_per_sample)


def sequential(calls, batch):
    """Each function after the other; a per-sample one row after row (what a plain loop does)."""
    out = []
    for call in calls:
        if call.is_async:
            out.append(asyncio.run(_rows_one_by_one(call, batch) if call.per_sample else call.run_async(batch)))
        else:
            out.append(call.run_sync(batch))
    return out


async def _rows_one_by_one(call, batch):
    return [await call.fn(**call._keywords(batch.row(i))) for i in range(len(batch))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the result here too")
    args = parser.parse_args()
    batch = RewardBatch([f"p{i}" for i in range(ROWS)], [f"c{i}" for i in range(ROWS)], [[i] for i in range(ROWS)],
                        {})
    calls = [RewardCall.of(f) for f in FUNCTIONS]
    call_all(calls, batch)  # start the pool and the event loop thread once
    timings = {}
    for name, run in (("concurrent (ppojax)", lambda: call_all(calls, batch)),
                      ("one after another", lambda: sequential(calls, batch))):
        start = time.perf_counter()
        results = run()
        timings[name] = round(time.perf_counter() - start, 3)
        assert [len(r) for r in results] == [ROWS] * len(calls)
    result = {"rows": ROWS, "functions": [f.__name__ for f in FUNCTIONS],
              "own_latency_sum_s": round(3 * BATCH_SLEEP + ROWS * ROW_SLEEP, 3),
              "slowest_single_call_s": max(BATCH_SLEEP, ROW_SLEEP), "wall_s": timings}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
