"""The demo itself: set up the models, run both sides on the same prompts, print the report.

Baseline: transformers' ``generate(do_sample=False)`` on the unpatched target. Optimized: a deep
copy of the target patched with ``patch_model`` (int8 weights + fused static-cache attention)
decoding with ``speculative_generate`` and the patched draft, and with ``prompt_lookup_generate``
(drafts looked up in each prompt and output, no draft model). The patched target's own greedy
``generate`` runs as well: both speculative outputs must equal it token for token (greedy
speculative decoding is exact by construction, so this is a real check), while they may differ
from the float baseline where int8 rounding flips a close argmax.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from gptfast_kernels.demo.data import ByteTokenizer, code_prompts, load_corpus
from gptfast_kernels.demo.training import TrainSettings, default_cache_dir, load_or_train

DEFAULT_CHECKPOINT_PROMPTS = ("def fibonacci(n):\n    ", "import numpy as np\n\n", "The capital of France is",
                              "Once upon a time, there was a")


@dataclass
class Side:
    """One way of generating, and what it produced over all batches."""
    name: str
    run: object                                   # (input_ids, attention_mask, max_new_tokens) -> [B, P + n]
    seconds: float = 0.0
    tokens: int = 0
    outputs: list = field(default_factory=list)   # per prompt: generated ids, cut after the first eos
    extra: dict = field(default_factory=dict)
    warmup_seconds: float = 0.0                   # its untimed first calls (compiling, with --compile)


def _usable_cpus() -> set[int] | None:
    """The CPUs this process may run on (None where the platform does not say)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


def _cpu_count() -> int:
    usable = _usable_cpus()
    return len(usable) if usable is not None else os.cpu_count() or 1


def _read_proc_stat() -> str:
    with open("/proc/stat") as handle:
        return handle.read()


def _busy_cpus(read_stat=_read_proc_stat, interval: float = 0.25) -> float | None:
    """How many of the CPUs this process may run on others kept busy over the last ``interval``
    seconds, from two readings of /proc/stat's per-CPU times (``read_stat()`` returns its text); None
    where it cannot be read. The load average would lag: a build that ended a minute ago (set-up
    compiling the extension, just before the README's demo command) still counts there."""
    usable = _usable_cpus()

    def busy_and_total() -> tuple[int, int]:
        busy = total = 0
        for line in read_stat().splitlines():
            name, *ticks = line.split()
            if name == "cpu" or not name.startswith("cpu") or (usable is not None and int(name[3:]) not in usable):
                continue
            ticks = [int(t) for t in ticks[:8]]  # user nice system idle iowait irq softirq steal
            busy += sum(ticks) - sum(ticks[3:5])
            total += sum(ticks)
        return busy, total

    try:
        busy0, total0 = busy_and_total()
        time.sleep(interval)
        busy1, total1 = busy_and_total()
    except (OSError, ValueError):
        return None
    if total1 <= total0:
        return None
    return _cpu_count() * (busy1 - busy0) / (total1 - total0)


def _choose_threads(requested: int | None) -> int:
    """The cores not busy right now (OpenMP threads that wait for a busy core make small models
    several times slower), at most torch's default. Busy: measured now (``_busy_cpus``), else the
    one-minute load average."""
    if requested is not None:
        return requested
    threads = torch.get_num_threads()
    busy = _busy_cpus()
    if busy is None:
        try:
            busy = os.getloadavg()[0]
        except (AttributeError, OSError):
            return threads
    return max(1, min(threads, int(_cpu_count() - busy + 0.5)))


def _device(name: str) -> torch.device:
    from gptfast_kernels.generate_cli import cli_device

    try:
        return cli_device("demo", name)
    except ValueError as error:
        raise SystemExit(str(error)) from None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _params(model) -> str:
    return f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters"


def _describe(model) -> str:
    c = model.config
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return (f"{type(model).__name__}, {c.num_hidden_layers} layer{'s' * (c.num_hidden_layers != 1)}, hidden "
            f"{c.hidden_size}, {c.num_attention_heads} heads ({kv} KV), {_params(model)}")


class _HFTokenizer:
    """A transformers tokenizer behind the ByteTokenizer interface (batch, decode)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token

    def batch(self, texts, device=None):
        encoded = self.tokenizer(list(texts), return_tensors="pt", padding=True)
        return encoded["input_ids"].to(device), encoded["attention_mask"].to(device)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _load_checkpoints(args, device, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gptfast_kernels.models.serialization import is_saved_patched

    def load(option: str, name: str):
        if is_saved_patched(name):  # (from_pretrained would find none of its int8 weights: random layers)
            raise SystemExit(f"demo: --{option} {name!r} is a directory save_patched wrote (already int8); the "
                             "demo patches a float checkpoint itself, beside its unpatched baseline: give that")
        try:
            return AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device).eval()
        except (OSError, ValueError) as error:  # (no such directory, no config or weights in it, no model class)
            raise SystemExit(f"demo: --{option} {name!r} could not be loaded as a causal language model: "
                             f"{str(error).strip().splitlines()[0]}") from None

    target, draft = load("model", args.model), load("draft", args.draft)
    try:
        tokenizer = _HFTokenizer(AutoTokenizer.from_pretrained(args.model))
        tokenizer_name = f"{type(tokenizer.tokenizer).__name__} from {args.model}"
    except (OSError, ValueError, TypeError):
        if target.config.get_text_config(decoder=True).vocab_size < 256:
            raise SystemExit(f"demo: {args.model} has no tokenizer and fewer than 256 tokens (byte-level fallback)")
        tokenizer, tokenizer_name = ByteTokenizer(), "none found: byte-level (token id = byte value)"
    vocab = [model.get_output_embeddings().weight.shape[0] for model in (target, draft)]
    if vocab[0] != vocab[1]:
        raise SystemExit(f"demo: {args.model} has {vocab[0]} output tokens but {args.draft} has {vocab[1]}; "
                         "speculative decoding needs a draft with the target's vocabulary")
    print("Models (local checkpoints)")
    print(f"  target : {args.model}: {_describe(target)}")
    print(f"  draft  : {args.draft}: {_describe(draft)}")
    print(f"  tokenizer: {tokenizer_name}")
    return target, draft, tokenizer, list(args.prompt or DEFAULT_CHECKPOINT_PROMPTS)


def _embedded_models(args, device, dtype):
    corpus = load_corpus()
    settings = TrainSettings(seconds=args.train_seconds, seed=args.seed, corpus=corpus.fingerprint)
    target, draft, info = load_or_train(settings, corpus, args.cache_dir or default_cache_dir(), device,
                                        progress_bar=not args.no_progress, retrain=args.retrain)
    target, draft = target.to(dtype), draft.to(dtype)
    stats, t = info["stats"], ByteTokenizer
    ratio = sum(p.numel() for p in target.parameters()) / sum(p.numel() for p in draft.parameters())
    print(f"Models (embedded default, byte-level: token = one UTF-8 byte, + pad/bos/eos = {t.vocab_size} tokens; "
          "no tokenizer, no download)")
    print(f"  target : {_describe(target)}")
    print(f"  draft  : {_describe(draft)}, {ratio:.1f}x smaller: the target's first "
          f"{'layer' if settings.draft_layers == 1 else f'{settings.draft_layers} layers'} with its embeddings, final "
          "norm and head (an early-exit draft, as in self-speculative decoding / LayerSkip)")
    print(f"  trained from random init on {stats['device']} for {stats['seconds'] + stats['draft_seconds']:.0f} s on "
          f"{info['corpus']}:")
    print(f"    target + early exit: {stats['seconds']:.0f} s, {stats['steps']} AdamW steps on "
          f"{stats['tokens'] / 1e6:.2f} M bytes; next-byte loss {stats.get('target_loss', float('nan')):.2f} nats, "
          f"exit vs target KL {stats.get('exit_kl', float('nan')):.2f}")
    print(f"    draft alone: {stats['draft_seconds']:.0f} s, {stats['draft_steps']} steps distilling it on the "
          f"target's greedy continuations; KL {stats.get('draft_kl', float('nan')):.2f} nats/byte")
    print("  (a minute of training makes code-flavoured text, not good code: the point is speed and exactness)")
    print(f"  {'loaded from cache' if info['cached'] else 'trained now, saved to'}: {info['path']}")
    prompts = list(args.prompt) if args.prompt else code_prompts(corpus, args.num_prompts)
    return target, draft, ByteTokenizer(), prompts


def _generated(sequences: torch.Tensor, prompt_width: int, eos: list[int]) -> list[list[int]]:
    """The new tokens of each row, up to and including its first eos."""
    rows = []
    for row in sequences[:, prompt_width:].tolist():
        cut = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        rows.append(row[:cut])
    return rows


def _run_sides(sides: list[Side], batches, max_new_tokens: int, eos: list[int], device, progress: bool) -> None:
    """Warms every side up, then runs the batches with the sides interleaved, so that load from
    other processes falls on all of them alike. The warm-up runs the widest batch of each batch size
    for the full number of new tokens: a compiled side builds a graph per batch size and per step
    width, and the longest prompt sizes the cache its graphs are specialised on."""
    from tqdm.auto import tqdm

    widest = {}
    for input_ids, mask in batches:
        size = input_ids.shape[0]
        if size not in widest or input_ids.shape[1] > widest[size][0].shape[1]:
            widest[size] = (input_ids, mask)
    for side in sides:  # allocations, kernel selection, compilation, first-call costs
        for input_ids, mask in widest.values():
            _sync(device)
            start = time.perf_counter()
            side.run(input_ids, mask, max_new_tokens)
            _sync(device)
            side.warmup_seconds += time.perf_counter() - start
        side.extra.clear()
    bar = tqdm(total=len(batches) * len(sides), unit="call", disable=not progress, leave=False)
    for input_ids, mask in batches:
        for side in sides:
            bar.set_description_str(side.name)
            _sync(device)
            start = time.perf_counter()
            sequences = side.run(input_ids, mask, max_new_tokens)
            _sync(device)
            side.seconds += time.perf_counter() - start
            rows = _generated(sequences, input_ids.shape[1], eos)
            side.outputs.extend(rows)
            side.tokens += sum(len(row) for row in rows)
            bar.update()
    bar.close()


def run_demo(args) -> int:
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' own bars (loading / saving weights) are noise here
    try:
        return _run_demo(args)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _run_demo(args) -> int:
    from gptfast_kernels import _extension, generate, patch_model, prompt_lookup_generate, speculative_generate
    from gptfast_kernels.generation.common import resolve_special_tokens

    device = _device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu":
        torch.set_num_threads(_choose_threads(args.threads))
    torch.manual_seed(args.seed)
    import transformers

    where = f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else \
        f"cpu ({torch.get_num_threads()} thread{'s' * (torch.get_num_threads() != 1)})"
    kernels = sorted(_extension.usable_backends(device)) if _extension.extension_loaded() else ["reference"]
    print(f"gptfast_kernels demo: {where}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"usable kernel backends {kernels}\n")
    started = time.perf_counter()
    if args.model is not None:
        target, draft, tokenizer, prompts = _load_checkpoints(args, device, dtype)
    else:
        target, draft, tokenizer, prompts = _embedded_models(args, device, dtype)
    setup_seconds = time.perf_counter() - started
    count = max(args.num_prompts, len(args.prompt or ()))  # every --prompt given, cycled up to --num-prompts
    prompts = [prompts[i % len(prompts)] for i in range(count)]
    eos, pad = resolve_special_tokens("demo", target, None)
    target.generation_config.pad_token_id = pad

    with torch.inference_mode():
        fast_target = patch_model(copy.deepcopy(target), int8=not args.no_int8, fused_attention=True)
        fast_draft = patch_model(copy.deepcopy(draft), int8=not args.no_int8, fused_attention=True)
        int8 = "int8" if not args.no_int8 else args.dtype

        def baseline(ids, mask, n):
            return target.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=pad)

        def own_greedy(ids, mask, n):
            return generate(fast_target, ids, mask, max_new_tokens=n, compile=args.compile).sequences

        def counted(side: int, out):
            counts = sides[side].extra
            counts["proposed"] = counts.get("proposed", 0) + int(out.num_proposed.sum())
            counts["accepted"] = counts.get("accepted", 0) + int(out.num_accepted.sum())
            return out.sequences

        def speculative(ids, mask, n):
            return counted(2, speculative_generate(fast_target, fast_draft, ids, mask, max_new_tokens=n,
                                                   speculate_k=args.speculate_k, compile=args.compile))

        def prompt_lookup(ids, mask, n):
            return counted(3, prompt_lookup_generate(fast_target, ids, mask, max_new_tokens=n,
                                                     speculate_k=args.speculate_k, compile=args.compile))

        sides = [Side(f"baseline: transformers generate, {args.dtype}", baseline),
                 Side(f"optimized: {int8} + fused attention", own_greedy),
                 Side(f"optimized + speculative (k={args.speculate_k})", speculative),
                 Side(f"optimized + prompt lookup (k={args.speculate_k}, no draft)", prompt_lookup)]
        batches = [tokenizer.batch(prompts[i:i + args.batch_size], device)
                   for i in range(0, len(prompts), args.batch_size)]
        steps = ("compiled (torch.compile" + (", CUDA graphs)" if device.type == "cuda" else ")") if args.compile
                 else "eager")
        print(f"\nGenerating: {len(prompts)} prompts in batches of {args.batch_size}, {args.max_new_tokens} new tokens "
              f"each, greedy; the optimized sides' decode steps {steps}; each side warmed up, then timed, the sides "
              f"taking turns batch by batch")
        _run_sides(sides, batches, args.max_new_tokens, eos, device, not args.no_progress)
    return _report(args, prompts, tokenizer, sides, setup_seconds, started)


def _acceptance(side: Side) -> str:
    proposed, accepted = side.extra.get("proposed", 0), side.extra.get("accepted", 0)
    rate = accepted / proposed if proposed else 0.0
    return f"{100 * rate:.1f}% ({accepted} of {proposed} draft tokens)"


def _report(args, prompts, tokenizer, sides, setup_seconds, started) -> int:
    baseline, own, spec, lookup = sides
    print(f"\n{'':<46}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{'speed-up':>10}")
    for side in sides:
        rate = side.tokens / side.seconds if side.seconds else float("nan")
        speedup = (side.tokens / side.seconds) / (baseline.tokens / baseline.seconds)
        print(f"  {side.name:<44}{side.tokens:>8}{side.seconds:>9.2f}{rate:>10.1f}{speedup:>9.2f}x")
    print("  warm-up, untimed: " + ", ".join(f"{side.name.split(':')[0].split(' (')[0]} {side.warmup_seconds:.1f} s"
                                          for side in sides)
          + (" (the optimized sides compile their steps in theirs)" if args.compile else ""))
    speedup = (spec.tokens / spec.seconds) / (baseline.tokens / baseline.seconds)
    own_match = sum(a == b for a, b in zip(spec.outputs, own.outputs))
    lookup_match = sum(a == b for a, b in zip(lookup.outputs, own.outputs))
    base_match = sum(a == b for a, b in zip(spec.outputs, baseline.outputs))
    n = len(prompts)
    print(f"\nspeed-up (speculative vs baseline): {speedup:.2f}x")
    print(f"acceptance rate: {_acceptance(spec)}")
    print(f"prompt lookup acceptance rate: {_acceptance(lookup)}")
    print("greedy outputs matched:")
    print(f"  speculative == optimized target's own greedy decoding: {own_match == n} ({own_match}/{n} prompts; "
          "exact by construction, so this checks the implementation)")
    print(f"  prompt lookup == optimized target's own greedy decoding: {lookup_match == n} ({lookup_match}/{n} "
          "prompts; exact by construction too)")
    note = ("int8 weights change the target's numerics, so a close argmax may flip and the texts diverge from there"
            if not args.no_int8 else "float weights: differences would only come from summation order")
    print(f"  speculative == {baseline.name.split(': ')[1]} baseline: {base_match == n} ({base_match}/{n} prompts; "
          f"{note})")
    print("\nSample (prompt 1):")
    print(f"  prompt      : {prompts[0]!r}")
    print(f"  baseline    : {tokenizer.decode(baseline.outputs[0])!r}")
    print(f"  speculative : {tokenizer.decode(spec.outputs[0])!r}")
    if args.model is None and all(len(set(tokenizer.decode(ids))) <= 1 for ids in baseline.outputs):
        # (a minute of training on busy CPUs: too few steps; the cache then keeps those weights)
        print("\nnote: every continuation is one character repeated: the embedded models got too few training "
              "steps on this machine (busy CPUs?), and the acceptance rates above are a degenerate model's. "
              "Rerun with --retrain and a larger --train-seconds.")
    print(f"\n(setup {setup_seconds:.1f} s, total {time.perf_counter() - started:.1f} s)")
    sys.stdout.flush()
    return 0 if own_match == n and lookup_match == n else 1
