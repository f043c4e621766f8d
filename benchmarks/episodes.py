"""Multi-turn episodes against single-turn sampling at the same total tokens: SmolLM2-135M-Instruct (the bundled
checkpoint) plays ``--episodes`` games of guess-the-number (``ppojax.tasks.guess_number``: real turns, the environment
answering "Higher." or "Lower." after each guess) on ``--slots`` cache rows (0: one row per episode; fewer: a row
whose episode ends takes the next waiting one; the batch's tail on a quarter of the rows, as a run plays it:
``ppojax.rl.episodes.tail_rows_for``), then the same rows sample single responses, no early stop, as many tokens in
all as the episodes' streams held. Both cut their decode loops as a run does (``--segments``, a run's
``decode_segments``), with the kernels a run on this backend takes (``ppojax.backends.kernels_for``).

Reported: tokens per second of each (an episode's tokens: the model's and the observations', prompt excluded; a
single response's: its tokens), their ratio, the mean turns, and the share of the episodes' wall time spent on the
host between turns (decoding the messages, stepping the environments, rendering and tokenizing the observations:
the device waits meanwhile). Medians over ``--repeats`` after one compiling call each; the episodes and the single
responses alternate, and the ratio is the median of each pair's.

    python -m benchmarks.episodes --episodes 48 --slots 16 --repeats 3 --json out.json
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers import AutoTokenizer

from benchmarks.common import machine_info, source_commit
from ppojax.agents import ChatRenderer, EnvironmentFactory, EpisodeHost
from ppojax.assets import smollm2_checkpoint
from ppojax.backends import kernels_for, use_kernels
from ppojax.io.strict_json import write_json
from ppojax.models import load_pretrained
from ppojax.rl.episodes import EpisodeShape, generate_episodes, host_callback, tail_rows_for
from ppojax.rl.sampler import generate
from ppojax.rl.settings import SamplingSettings
from ppojax.tasks.guess_number import GuessNumber, records
from ppojax.trainer.data import left_pad


class TimedHost:
    """An EpisodeHost whose turns are timed (the host's share of the wall time)."""

    def __init__(self, host: EpisodeHost):
        self.host, self.seconds = host, 0.0

    def turn(self, *args):
        start = time.perf_counter()
        try:
            return self.host.turn(*args)
        finally:
            self.seconds += time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--slots", type=int, default=0, help="cache rows (0: one per episode)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--turn-length", type=int, default=12)
    parser.add_argument("--observation-length", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=1,
                        help="episodes per prompt (GRPO's num_generations), each prompt prefilled once; the single "
                             "responses take the same groups")
    parser.add_argument("--segments", type=int, default=SamplingSettings.decode_segments,
                        help="the loops each sampler cuts its decode into, each reading only the cache slots filled "
                             "by its end (a run's decode_segments)")
    parser.add_argument("--slot-alignment", type=int, default=None,
                        help="what both samplers round the cache slots they read up to (default: the kernels', "
                             "Kernels.slot_alignment)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    path = smollm2_checkpoint(log=lambda *a, **k: None)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model, _ = load_pretrained(path)
    use_kernels(kernels_for([model]), model)  # the backend's kernels, as a run takes them
    graphdef, params = nnx.split(model)
    stop, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    shape = EpisodeShape(turn_length=args.turn_length, observation_length=args.observation_length,
                         max_turns=args.turns, episode_length=args.turns * (args.turn_length + args.observation_length))
    games, rows = list(records(0, args.episodes)), min(args.slots or args.episodes, args.episodes)
    group = args.group_size
    if args.episodes % group or rows % group:
        parser.error(f"--group-size {group} must divide --episodes {args.episodes} and the rows {rows}")
    renderer = ChatRenderer(tokenizer, end_of_turn="<|im_end|>")
    host = TimedHost(EpisodeHost(EnvironmentFactory(GuessNumber), renderer, tokenizer, stop_token_id=stop,
                                 pad_token_id=pad, observation_length=shape.observation_length,
                                 episode_length=shape.episode_length, max_turns=shape.max_turns))
    messages = [[{"role": "user", "content": g["prompt"]}] for g in games]
    prompt_ids = [renderer.prompt_ids(m) for m in messages]
    prompts = jnp.asarray(left_pad(prompt_ids, max(map(len, prompt_ids)), pad))[::group]  # each group's once

    play = jax.jit(lambda p, x, k: generate_episodes(graphdef, p, x, k, shape=shape,
                                                     host_turn=host_callback(host.turn, shape),
                                                     pad_token_id=pad, stop_token_id=stop, temperature=0.7,
                                                     slots=args.slots, group_size=group,
                                                     tail_rows=tail_rows_for(rows), segments=args.segments,
                                                     slot_alignment=args.slot_alignment))
    def play_once(repeat):
        host.host.begin(games, list(range(args.episodes)), messages)
        host.seconds = 0.0
        start = time.perf_counter()
        out = jax.block_until_ready(play(params, prompts, jax.random.key(repeat)))
        seconds = time.perf_counter() - start
        return seconds, host.seconds / seconds, int(np.sum(np.asarray(out.stream) != pad)), float(np.mean(
            np.asarray(out.turns)))

    first_tokens = play_once(0)[2]  # the compile
    length = max(1, round(first_tokens / rows))  # the same rows, as many tokens in all
    single = jax.jit(lambda p, x, k: generate(graphdef, p, x, k, response_length=length, pad_token_id=pad,
                                              temperature=0.7, group_size=group, segments=args.segments,
                                              slot_alignment=args.slot_alignment))
    jax.block_until_ready(single(params, prompts[:rows // group], jax.random.key(0)))  # the compile
    # the two alternate, so a slower spell of the host weighs on both: each pair's ratio, then their median
    episode_times, host_shares, tokens, turns, single_times, ratios = [], [], [], [], [], []
    for repeat in range(1, args.repeats + 1):
        seconds, share, n, mean_turns = play_once(repeat)
        start = time.perf_counter()
        jax.block_until_ready(single(params, prompts[:rows // group], jax.random.key(repeat)))
        single_times.append(time.perf_counter() - start)
        episode_times.append(seconds)
        host_shares.append(share)
        tokens.append(n)
        turns.append(mean_turns)
        ratios.append((n / seconds) / (rows * length / single_times[-1]))
    episode_s, single_s = statistics.median(episode_times), statistics.median(single_times)
    episode_tokens = int(statistics.median(tokens))
    episode_rate, single_rate = episode_tokens / episode_s, rows * length / single_s
    report = dict(episodes=args.episodes, rows=rows, group_size=group, tail_rows=tail_rows_for(rows),
                  single_segments=args.segments, kernels=model.kernels.name,
                  slot_alignment=args.slot_alignment or model.kernels.slot_alignment,
                  shape=dict(turn_length=shape.turn_length, observation_length=shape.observation_length,
                             max_turns=shape.max_turns, episode_length=shape.episode_length),
                  mean_turns=statistics.median(turns), episode_tokens=episode_tokens, episode_s=episode_s,
                  episode_tokens_per_s=episode_rate, single_response_length=length, single_s=single_s,
                  single_tokens_per_s=single_rate, ratio=statistics.median(ratios), ratios=ratios,
                  host_share=statistics.median(host_shares), machine=machine_info(), commit=source_commit())
    print(f"episodes: {episode_tokens} tokens in {episode_s:.2f} s ({episode_rate:.1f} tokens/s, "
          f"{report['mean_turns']:.2f} turns, host {100 * report['host_share']:.1f} % of the time); single turn: "
          f"{rows} x {length} tokens in {single_s:.2f} s ({single_rate:.1f} tokens/s); ratio "
          f"{report['ratio']:.2f}")
    if args.json:
        write_json(args.json, report, indent=2)
    return report


if __name__ == "__main__":
    main()
