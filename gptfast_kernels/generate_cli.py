"""``python -m gptfast_kernels generate MODEL PROMPT ...``: text in, text out, from the command line.

Loads MODEL (a checkpoint from_pretrained loads, patched here, or a directory save_patched wrote,
loaded as saved) and its tokenizer, decodes every prompt in one batch (left padding) with
``generate``, or ``speculative_generate`` with ``--draft`` or ``prompt_lookup_generate`` with
``--prompt-lookup``, or through a ``ContinuousBatcher`` with ``--batch-size N`` (more prompts than
one batch: a freed row takes the next prompt; with ``--draft`` or ``--prompt-lookup``, a
``SpeculativeBatcher``), and prints each continuation. A single prompt is
streamed as it is decoded.
Speed (and the acceptance rate of a speculative run) goes to standard error.
"""

from __future__ import annotations

import sys
import time

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cli_device(op: str, name: str | None) -> torch.device:
    """A command's ``--device`` (None or "auto": CUDA when torch sees a GPU, else the CPU) as a
    torch.device; ValueError naming the flag for a string that is no device, a GPU torch does not
    see, or a device type the kernels do not serve."""
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{op}: --device {name!r} is not a device (auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{op}: --device {name}: torch sees no CUDA device")
        if device.index is not None and device.index >= count:
            raise ValueError(f"{op}: --device {name}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    elif device.type != "cpu":
        raise ValueError(f"{op}: --device {name}: the kernels run on cpu and cuda devices only")
    return device


def _message(error: Exception) -> str:
    """A library error for the generate command: prefixed with the command's name unless it
    names it already (``generate: ...``)."""
    text = str(error)
    return text if text.startswith("generate: ") else f"generate: {text}"


def add_generate_parser(sub):
    parser = sub.add_parser("generate", help="generate text from prompts with a (patched) checkpoint")
    parser.add_argument("model", help="a local checkpoint or hub name, or a directory save_patched wrote")
    parser.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts ('-': standard input)")
    parser.add_argument("--prompts-file", metavar="FILE", help="more prompts, one per line (blank lines skipped)")
    way = parser.add_mutually_exclusive_group()
    way.add_argument("--draft", metavar="MODEL", help="a draft model (same tokenizer): speculative decoding")
    way.add_argument("--prompt-lookup", action="store_true", help="speculate from the prompt's own n-grams")
    parser.add_argument("--batch-size", type=int, metavar="N",
                        help="continuous batching over N rows (ContinuousBatcher; with --draft or --prompt-lookup "
                             "SpeculativeBatcher), for more prompts than fit one batch; default: every prompt in one "
                             "batch")
    parser.add_argument("--max-prefill-tokens", type=int, metavar="N",
                        help="with --batch-size: at most N prompt tokens a step, long prompts going in over several "
                             "steps beside the decoding rows (default: whole prompts)")
    parser.add_argument("--reuse-prefixes", action="store_true",
                        help="with --batch-size: a prompt that begins as a cache row's tokens "
                             "(a shared system prompt) takes their keys and values instead of running them")
    parser.add_argument("--speculate-k", type=int, default=4, help="draft tokens per round (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="per prompt (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--min-p", type=float)
    parser.add_argument("--repetition-penalty", type=float)
    parser.add_argument("--stop", nargs="+", default=None, metavar="TEXT", help="stop strings")
    parser.add_argument("--seed", type=int, help="for sampling (default: unseeded)")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="the float weights' and activations' dtype (default: bfloat16 on a GPU, float32 on "
                             "the CPU; a save_patched directory its own unless this is given)")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("--no-int8", action="store_true", help="keep the checkpoint's float weights")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode steps (CUDA graphs on GPUs)")
    parser.add_argument("--trust-remote-code", action="store_true")
    return cmd_generate


def cmd_generate(args) -> int:
    from transformers import TextStreamer

    from gptfast_kernels import generate, prompt_lookup_generate, speculative_generate
    from gptfast_kernels.compat import _load, padding_tokenizer, text_eos_ids
    from gptfast_kernels.models.patch import is_patched, patch_model
    from gptfast_kernels.models.serialization import is_saved_patched

    prompts = [sys.stdin.read() if p == "-" else p for p in args.prompts]
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as error:
            print(f"generate: cannot read --prompts-file: {error}", file=sys.stderr)
            return 2
    if not prompts:
        print("generate: no prompt given (PROMPT ..., '-' for standard input, or --prompts-file)", file=sys.stderr)
        return 2
    try:
        device = cli_device("generate", args.device)
    except ValueError as error:
        print(str(error), file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    models = {"model": args.model, **({"draft": args.draft} if args.draft else {})}
    loaded = {}
    for role, name in models.items():
        try:
            model = _load("generate", role, name, device=device, trust_remote_code=args.trust_remote_code,
                          dtype=None if is_saved_patched(name) and not args.dtype else dtype)
            if is_patched(model) and args.no_int8 and model._gptfast_patch_options["int8"]:
                raise ValueError("it is a directory save_patched wrote with int8 weights, and --no-int8 cannot "
                                 "undo them; give the float checkpoint")
            loaded[role] = model if is_patched(model) else patch_model(model, int8=not args.no_int8)
        except (OSError, ValueError) as error:  # (patch_model's: a family it does not serve)
            print(f"generate: cannot load {role} {name!r}: {error}", file=sys.stderr)
            return 2
    try:
        tokenizer = padding_tokenizer("generate", "model", args.model, args.trust_remote_code)
    except ValueError as error:
        print(str(error), file=sys.stderr)
        return 2
    for flag, given in (("--max-prefill-tokens", args.max_prefill_tokens is not None),
                        ("--reuse-prefixes", args.reuse_prefixes)):
        if given and args.batch_size is None:
            print(f"generate: {flag} needs --batch-size (continuous batching)", file=sys.stderr)
            return 2
    if args.batch_size is not None:
        return _continuous(args, loaded["model"], loaded.get("draft"), tokenizer, prompts, device)
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(device)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if len(prompts) == 1 else None
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                   stop_strings=args.stop, tokenizer=tokenizer if args.stop else None, compile=args.compile,
                   streamer=streamer, eos_token_id=text_eos_ids(loaded["model"], tokenizer),
                   generator=None if args.seed is None else torch.Generator(device).manual_seed(args.seed))
    started = time.perf_counter()
    try:
        if args.draft:
            out = speculative_generate(loaded["model"], loaded["draft"], batch.input_ids, batch.attention_mask,
                                       speculate_k=args.speculate_k, **options)
        elif args.prompt_lookup:
            out = prompt_lookup_generate(loaded["model"], batch.input_ids, batch.attention_mask,
                                         speculate_k=args.speculate_k, **options)
        else:
            out = generate(loaded["model"], batch.input_ids, batch.attention_mask, **options)
    except (TypeError, ValueError) as error:
        print(_message(error), file=sys.stderr)
        return 2
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    new = out.sequences[:, batch.input_ids.shape[1]:]
    if streamer is None:
        for i, row in enumerate(new):
            print(f"--- {i}\n{tokenizer.decode(row, skip_special_tokens=True)}")
    made = int(sum(_made(row, tokenizer.pad_token_id) for row in new))
    rate = f", {out.acceptance_rate:.1%} of drafts accepted" if hasattr(out, "acceptance_rate") else ""
    print(f"generate: {made} new tokens in {seconds:.2f} s ({made / seconds:.1f} tokens/s{rate})", file=sys.stderr)
    return 0


def _continuous(args, model, draft, tokenizer, prompts: list[str], device: torch.device) -> int:
    """Every prompt through a ContinuousBatcher of ``args.batch_size`` rows (a SpeculativeBatcher with
    ``draft`` or ``--prompt-lookup``); each continuation printed in the prompts' order."""
    from gptfast_kernels import ContinuousBatcher, SpeculativeBatcher
    from gptfast_kernels.compat import text_eos_ids

    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    speculative = draft is not None or args.prompt_lookup
    started = time.perf_counter()
    try:
        settings = dict(batch_size=args.batch_size, max_length=max(map(len, encoded)) + args.max_new_tokens - 1,
                        eos_token_id=text_eos_ids(model, tokenizer), tokenizer=tokenizer, compile=args.compile,
                        generator=None if args.seed is None else torch.Generator(device).manual_seed(args.seed))
        settings["max_prefill_tokens"] = args.max_prefill_tokens
        settings["reuse_prefixes"] = args.reuse_prefixes
        batcher = (SpeculativeBatcher(model, draft, speculate_k=args.speculate_k, **settings) if speculative
                   else ContinuousBatcher(model, **settings))
        for ids in encoded:
            batcher.submit(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                           stop_strings=args.stop)
    except (TypeError, ValueError) as error:
        print(_message(error), file=sys.stderr)
        return 2
    out = batcher.run()
    seconds = time.perf_counter() - started
    for i, tokens in out.items():
        print(f"--- {i}\n{tokenizer.decode(tokens, skip_special_tokens=True)}")
    made = sum(map(len, out.values()))
    rate = f", {batcher.acceptance_rate:.1%} of drafts accepted" if speculative else ""
    print(f"generate: {made} new tokens in {seconds:.2f} s ({made / seconds:.1f} tokens/s, continuous batching over "
          f"{args.batch_size} rows{rate})", file=sys.stderr)
    return 0


def _made(row: torch.Tensor, pad: int | None) -> int:
    """New tokens of one row: up to its trailing padding (a row that stopped is padded after)."""
    tokens = row.tolist()
    while tokens and pad is not None and tokens[-1] == pad:
        tokens.pop()
    return len(tokens)
