"""``python -m gptfast_kernels demo``: transformers' generate against int8 + fused attention +
speculative decoding, side by side on the same prompts.

With no arguments it needs no download: a small byte-level Llama target and draft are built from
configs, trained for about a minute on the Python standard library's sources and cached
(``--cache-dir``). ``--model PATH --draft PATH`` runs the same comparison on local checkpoints.

This module only defines the command line (the CLI imports it on every command); the work is in
``gptfast_kernels.demo.run``.
"""

from __future__ import annotations

import argparse


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def add_demo_parser(subparsers) -> callable:
    """Adds the ``demo`` sub-command to ``subparsers``; returns ``cmd(args) -> int`` that runs it."""
    parser = subparsers.add_parser(
        "demo", help="baseline vs int8 + fused attention + speculative decoding, side by side",
        description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    models = parser.add_argument_group("models (default: the embedded byte-level pair, trained and cached)")
    models.add_argument("--model", metavar="PATH",
                        help="target checkpoint (from_pretrained; its tokenizer when present)")
    models.add_argument("--draft", metavar="PATH", help="draft checkpoint sharing the target's vocabulary")
    models.add_argument("--train-seconds", type=_positive_float, default=60.0,
                        help="training budget for the embedded models, target and draft together (default 60)")
    models.add_argument("--cache-dir", metavar="DIR",
                        help="where trained embedded models are kept (default: .demo_cache/ in a source checkout, "
                             "else ~/.cache/gptfast_kernels/demo)")
    models.add_argument("--retrain", action="store_true", help="train again even when a cached model exists")
    gen = parser.add_argument_group("generation")
    gen.add_argument("--prompt", action="append", metavar="TEXT",
                     help="a prompt (repeat for several; default: code from held-out standard-library files)")
    gen.add_argument("--num-prompts", type=_positive_int, default=4, help="prompts to run (default 4)")
    gen.add_argument("--batch-size", type=_positive_int, default=1, help="prompts per generate call (default 1)")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128, help="new tokens per prompt (default 128)")
    gen.add_argument("--speculate-k", type=_positive_int, default=4, help="draft tokens per round (default 4)")
    gen.add_argument("--no-int8", action="store_true", help="keep float weights on the optimized side")
    gen.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                     help="run the optimized sides' decode steps through torch.compile, as CUDA graphs on a GPU "
                          "(default); their first calls compile them (tens of seconds on a CPU, once: torch keeps "
                          "compiled code on disk), which the warm-up takes and the timings leave out. "
                          "--no-compile: eager steps, as transformers' generate runs")
    run = parser.add_argument_group("run")
    run.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:N")
    run.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                     help="activation / weight dtype of both sides (default float32)")
    run.add_argument("--threads", type=_positive_int, help="CPU threads (default: the cores not busy right now)")
    run.add_argument("--seed", type=int, default=0, help="seed for model init, training and batches (default 0)")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")

    def cmd(args) -> int:
        if (args.model is None) != (args.draft is None):
            parser.error("--model and --draft go together")
        from gptfast_kernels.demo.run import run_demo

        return run_demo(args)

    return cmd


__all__ = ["add_demo_parser"]
