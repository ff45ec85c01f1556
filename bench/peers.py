"""Baton against peer servers (llama.cpp's llama-server, vLLM, ...) on one workload, each
through its own OpenAI-compatible HTTP API, interleaved by round.

The scenarios are the speed issue's table, all streamed completions at temperature 0
with `ignore_eos`:
- `single_stream_decode_tok_s`: one request at a time (a 32-word prompt, --output-len
  tokens); decode tokens/s after the first token, the median of a round's requests;
- `c8_tok_s`, `c32_tok_s`: 8 / 32 requests in flight, aggregate output tokens/s;
- `ttft_512_s`: a fresh 512-word prompt, one new token: time to first token, the
  median of a round's three (each once the machine is idle);
- `ttft_1024_cached_s`: a 1,024-word prompt whose first 960 words an earlier request
  sent (a prefix cache's case), and `ttft_1024_cold_s`: the same length, fresh.
Prompts are words that most tokenizers make one token each; every line carries the
prompt tokens the server counted. They come from a fresh seed each run (printed in every
line; --seed repeats one), since a server may keep an earlier run's prompts cached.
Each round runs every scenario on every system in turn, each turn once the machine is
idle (`settle`), so drift on a shared machine falls on all alike, and each round starts
with the next system, so that none always follows the same one; the medians over
--rounds are printed per system, then `ratio.<scenario>.<system>_over_<peer>` for the
first system (Baton) over each other one (for TTFT lower is better, so a ratio under 1
is a win).

    .venv/bin/python bench/peers.py [--system baton=http://localhost:8000/v1]
        [--system llama.cpp=http://localhost:8080/v1] [--system vllm=http://localhost:8001/v1]
        [--rounds 3] [--output-len 128] [--scenarios single,c8,c32,ttft512,ttft1024]
        [--seed N]

Servers are started beforehand: Baton by the README's first command; the peers as the
speed issue says (neither is a dependency of Baton).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from common import emit, git_commit, log, median

from serve_app.ops.bench import load
from serve_app.ops.bench.stream_client import Endpoint, RequestResult
from serve_app.ops.bench.workload import BenchRequest, synthetic

# Scenario -> (metric, unit, whether lower is better).
SCENARIOS = {
    "single": ("single_stream_decode_tok_s", "tok/s", False),
    "c8": ("c8_tok_s", "tok/s", False),
    "c32": ("c32_tok_s", "tok/s", False),
    "ttft512": ("ttft_512_s", "s", True),
    "ttft1024": ("ttft_1024_cached_s", "s", True),
}
COLD_1024 = ("ttft_1024_cold_s", "s", True)
SINGLE_REQUESTS = 3  # per round: a median of three streams
TTFT_REQUESTS = 3  # per round: a median of three 512-word prompts
# Before each system's turn at a scenario the machine must be this idle (busy share of
# all cores over a window), at most SETTLE_MAX_S: a server that keeps its cores busy
# after its requests (vLLM's worker spins for about a second) must not slow the next.
SETTLE_BUSY, SETTLE_WINDOW_S, SETTLE_MAX_S = 0.2, 0.3, 15.0


class Prompts:
    """Fresh prompts for every call (a number first, so no two share a prefix block),
    the same sequence for every system: round r of each system sees the same texts."""

    def __init__(self, seed: int):
        self.seed = seed

    def batch(self, key: str, round_: int, num: int, words: int, output_len: int):
        seed = random.Random(f"{self.seed}/{key}/{round_}").randrange(2**31)
        return [
            BenchRequest(f"{key} {r.prompt}", r.max_tokens)
            for r in synthetic(num, words, output_len, seed)
        ]

    def shared_prefix(self, round_: int, prefix_words: int, words: int) -> tuple[str, str]:
        """(a prompt of `prefix_words`, one of `words` starting with it)."""
        rng = random.Random(f"{self.seed}/prefix/{round_}")
        (head,) = synthetic(1, prefix_words, 1, rng.randrange(2**31))
        (tail,) = synthetic(1, words - prefix_words + 1, 1, rng.randrange(2**31))
        return head.prompt, f"{head.prompt} {tail.prompt.split(' ', 1)[1]}"


def _checked(results: list[RequestResult], what: str) -> list[RequestResult]:
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{what}: {len(failed)} of {len(results)} failed: {failed[0]}")
    return results


def _ttft(endpoint: Endpoint, prompt: str, what: str) -> tuple[float, int]:
    (result,) = _checked([endpoint.complete(BenchRequest(prompt, 1))], what)
    return result.ttft, result.prompt_tokens


def run_scenario(
    name: str, endpoint: Endpoint, prompts: Prompts, round_: int, output_len: int
) -> list[tuple[tuple[str, str, bool], float, int]]:
    """[(metric, value, prompt tokens of one request)] of one scenario on one system."""
    if name == "single":
        requests = prompts.batch(name, round_, SINGLE_REQUESTS, 32, output_len)
        results = _checked([endpoint.complete(r) for r in requests], name)
        rate = statistics.median(1 / r.tpot for r in results)
        return [(SCENARIOS[name], rate, results[0].prompt_tokens)]
    if name in ("c8", "c32"):
        concurrency = int(name[1:])
        requests = prompts.batch(name, round_, concurrency, 32, output_len)
        progress = load.Progress(name, len(requests), enabled=False)
        results, seconds = load.at_concurrency(endpoint.complete, requests, concurrency, progress)
        tokens = sum(r.output_tokens for r in _checked(results, name))
        return [(SCENARIOS[name], tokens / seconds, results[0].prompt_tokens)]
    if name == "ttft512":
        times = []
        for request in prompts.batch(name, round_, TTFT_REQUESTS, 512, 1):
            settle()  # the request before must not slow this one
            ttft, tokens = _ttft(endpoint, request.prompt, name)
            times.append(ttft)
        return [(SCENARIOS[name], statistics.median(times), tokens)]
    if name == "ttft1024":
        head, prompt = prompts.shared_prefix(round_, 960, 1024)
        _ttft(endpoint, head, "the 960-word prefix")  # what the cache then holds
        cached, tokens = _ttft(endpoint, prompt, name)
        (cold,) = prompts.batch("cold1024", round_, 1, 1024, 1)
        return [(SCENARIOS[name], cached, tokens), (COLD_1024, *_ttft(endpoint, cold.prompt, name))]
    raise ValueError(f"--scenarios: unknown scenario {name!r}; choose from {sorted(SCENARIOS)}")


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores from /proc/stat; None off Linux."""
    stat = Path("/proc/stat")
    if not stat.exists():
        return None
    fields = [int(v) for v in stat.read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return sum(fields) - idle, sum(fields)


def settle() -> float:
    """Waits until the machine's cores are at most SETTLE_BUSY busy over a window (or
    SETTLE_MAX_S passed); returns the seconds waited."""
    start = time.monotonic()
    before = _cpu_times()
    while before is not None and time.monotonic() - start < SETTLE_MAX_S:
        time.sleep(SETTLE_WINDOW_S)
        after = _cpu_times()
        busy, total = after[0] - before[0], after[1] - before[1]
        if total and busy / total <= SETTLE_BUSY:
            break
        before = after
    else:
        if before is not None:
            log(f"the machine stayed over {SETTLE_BUSY:.0%} busy for {SETTLE_MAX_S:.0f} s")
    return time.monotonic() - start


def _system(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url:
        raise argparse.ArgumentTypeError(f"--system takes NAME=URL, got {text!r}")
    return name, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--system",
        type=_system,
        action="append",
        help="NAME=BASE_URL, first Baton (default baton=http://localhost:8000/v1)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="the prompts' seed; by default a fresh one, so that no server answers from a "
        "cache of an earlier run's prompts (llama-server keeps them)",
    )
    args = parser.parse_args()
    seed = random.randrange(2**31) if args.seed is None else args.seed
    systems = args.system or [("baton", "http://localhost:8000/v1")]
    scenarios = [s for s in args.scenarios.split(",") if s]
    endpoints = {name: Endpoint(url, None, None, args.timeout_s) for name, url in systems}
    prompts = Prompts(seed)
    for name, url in systems:  # each server's first request is not timed
        endpoints[name].complete(BenchRequest("Warm up.", 4))
        log(f"{name}: {endpoints[name].model} at {url}")

    values: dict[tuple[str, str], list[float]] = {}
    units: dict[str, tuple[str, bool]] = {}
    tokens: dict[tuple[str, str], int] = {}
    names = list(endpoints)
    for round_ in range(args.rounds):
        # Round r starts with system r (mod the count): each follows each other in turn.
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for scenario in scenarios:
            for name in order:
                endpoint = endpoints[name]
                settle()
                for (metric, unit, lower), value, prompt_tokens in run_scenario(
                    scenario, endpoint, prompts, round_, args.output_len
                ):
                    values.setdefault((metric, name), []).append(value)
                    units[metric] = (unit, lower)
                    tokens[(metric, name)] = prompt_tokens
                    log(f"round {round_ + 1} {metric} {name}: {value:.3f} {unit}")

    context = {
        "rounds": args.rounds,
        "output_len": args.output_len,
        "seed": seed,
        "commit": git_commit(),
    }
    for (metric, name), series in values.items():
        emit(
            metric,
            median(series),
            units[metric][0],
            system=name,
            model=endpoints[name].model,
            prompt_tokens=tokens[(metric, name)],
            **context,
        )
    first, *peers = endpoints
    for metric, (_, lower) in units.items():
        for peer in peers:
            ratio = median(values[(metric, first)]) / median(values[(metric, peer)])
            better = "lower" if lower else "higher"
            emit(f"ratio.{metric}.{first}_over_{peer}", ratio, "ratio", better=better, **context)


if __name__ == "__main__":
    main()
