"""A warm start for the calculator task: SmolLM2-135M-Instruct fine-tuned on a few written calculator episodes,
saved as a checkpoint that configs/math_tools_grpo.yaml can start from.

Shown the calculator only in its system prompt (or even in two worked examples), the 135M model almost never calls
it, and GRPO has no call to reinforce (docs/agents.md). Here each of N problems from the END of the built-in
arithmetic task's train split (a run's first updates draw from its start; the test split never appears) becomes
the episode a tool user would have: a call with the problem's expression, the tool's result, the final
``#### n``; laid out token for token as the run's episodes are (``ppojax.agents.demonstrations``) and trained on
the model's messages only (``ppojax.trainer.warm_start``). Then::

    python examples/calculator_warm_start.py --out outputs/calculator_warm_start
    ppojax train configs/math_tools_grpo.yaml model_name_or_path=outputs/calculator_warm_start

The defaults (64 episodes, one epoch of 8 steps) take a few minutes on a 2-core CPU.
"""
import argparse
import json

from flax import nnx

from ppojax import assets
from ppojax.agents import CHATML_TOOLS_TEMPLATE, ChatRenderer, tool_schemas
from ppojax.agents.demonstrations import episode_stream
from ppojax.errors import ExportDirError
from ppojax.io.export_dir import check_export_target
from ppojax.models import load_pretrained, load_tokenizer, save_pretrained
from ppojax.tasks.calculator import calculate, demonstration
from ppojax.trainer.prompt_sources import arithmetic_split
from ppojax.trainer.warm_start import pad_streams, warm_start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the checkpoint directory to write (new or empty)")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=3e-5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    lines = arithmetic_split("arithmetic").read_text().splitlines()
    # a bad value is refused here, before the model loads or trains
    if not 1 <= args.episodes <= len(lines):
        parser.error(f"--episodes {args.episodes}: expected 1 to the {len(lines)} problems of the train split")
    if not 1 <= args.batch_size <= args.episodes:
        parser.error(f"--batch-size {args.batch_size}: expected 1 to --episodes ({args.episodes})")
    if args.epochs < 1 or args.learning_rate <= 0:
        parser.error("--epochs and --learning-rate must be positive")
    try:
        check_export_target(args.out)
    except ExportDirError as err:
        parser.error(f"--out: {err}")

    folder = assets.smollm2_checkpoint()
    tokenizer = load_tokenizer(folder)
    end_of_turn = "<|im_end|>"  # ChatML's, the run's stop token (stop_token: eos)
    renderer = ChatRenderer(tokenizer, end_of_turn=end_of_turn, chat_template=CHATML_TOOLS_TEMPLATE,
                            tools=tool_schemas([calculate]))
    records = [json.loads(line) for line in lines[len(lines) - args.episodes:]]
    streams = [episode_stream(renderer, demonstration(r), end_of_turn_id=tokenizer.convert_tokens_to_ids(end_of_turn))
               for r in records]
    batch = pad_streams(streams, tokenizer.pad_token_id)
    print(f"{len(streams)} episodes of up to {batch['ids'].shape[1]} tokens, {int(batch['trained'].sum())} trained")

    model, config = load_pretrained(folder)
    graphdef, params = nnx.split(model)
    params, _ = warm_start(graphdef, params, batch, learning_rate=args.learning_rate, batch_size=args.batch_size,
                           epochs=args.epochs, seed=args.seed,
                           log=lambda step, loss: print(f"step {step}: loss {loss:.4f}", flush=True))
    save_pretrained(nnx.merge(graphdef, params), config, args.out, tokenizer=tokenizer)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
