"""Continuous batching against static batches: the same requests (random prompts of 8 to 48 tokens,
half of them asking for few new tokens and half for many, as a chat workload mixes short and long
answers; greedy, no eos, so each makes exactly its max_new_tokens) served by ``ContinuousBatcher``
(a freed row takes the next request at once) and by ``generate`` over consecutive batches of the
same size (each row stops at its own limit, the batch runs until its longest row). Both must give
every request the same tokens; a row gives the wall seconds for all requests (the faster of two
runs, after a warm-up), the tokens per second and the number of model forwards. The same pair with
speculative rounds (prompt lookup, k = 4): ``SpeculativeBatcher`` (new prompts in the rounds'
forwards) against ``prompt_lookup_generate`` over the same static batches; greedy speculative
decoding is exact, so all four give every request generate's tokens. Then chunked prefill: the same kind of requests with a few long prompts among
them, served with whole prompts and with ``max_prefill_tokens``: the longest step (what a running
request waits for its next token) and the throughput. Then prefix reuse: requests that all begin
with one system prompt, with and without ``reuse_prefixes``.

CPU: a small Llama (hidden 256, 4 layers) in float32, eager. GPU: Llama-3.2-1B's shapes in bfloat16,
compiled decode steps (CUDA graphs). int8 weights either way.
"""

from __future__ import annotations

import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench import cuda_graph_records
from gptfast_kernels import ContinuousBatcher, SpeculativeBatcher, generate, patch_model, prompt_lookup_generate

CPU_CONFIG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=4096, max_position_embeddings=1024)
GPU_CONFIG = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096, tie_word_embeddings=True)
BATCH = 8
REPEATS = 2
K = 4  # draft tokens per speculative round


def _workload(requests: int, vocab: int) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(0)
    work = []
    for i in range(requests):
        prompt = torch.randint(3, vocab, (int(torch.randint(8, 49, (), generator=g)),), generator=g).tolist()
        short = i % 2 == 0
        limit = int(torch.randint(8, 25, (), generator=g)) if short else int(torch.randint(96, 129, (), generator=g))
        work.append((prompt, limit))
    perm = torch.randperm(requests, generator=g).tolist()
    return [work[i] for i in perm]


def _static(model, work, device, compile) -> tuple[dict[int, list[int]], int, None]:
    """generate over consecutive batches -> (tokens per request, forwards: a prefill and the decode
    steps of each batch, None)."""
    out, forwards = {}, 0
    for start in range(0, len(work), BATCH):
        chunk = work[start:start + BATCH]
        ids, mask = _left_padded([p for p, _ in chunk], device)
        limits = [n for _, n in chunk]
        seqs = generate(model, ids, mask, max_new_tokens=limits, eos_token_id=[],
                        compile=compile).sequences[:, ids.shape[1]:].tolist()
        for b, n in enumerate(limits):
            out[start + b] = seqs[b][:n]
        forwards += max(limits)
    return out, forwards, None


def _static_lookup(model, work, device, compile) -> tuple[dict[int, list[int]], None, float]:
    """prompt_lookup_generate over consecutive batches -> (tokens per request, None: its rounds are
    not counted, the acceptance rate over all batches)."""
    out, proposed, accepted = {}, 0, 0
    for start in range(0, len(work), BATCH):
        chunk = work[start:start + BATCH]
        ids, mask = _left_padded([p for p, _ in chunk], device)
        limits = [n for _, n in chunk]
        result = prompt_lookup_generate(model, ids, mask, max_new_tokens=limits, eos_token_id=[], speculate_k=K,
                                        compile=compile)
        seqs = result.sequences[:, ids.shape[1]:].tolist()
        for b, n in enumerate(limits):
            out[start + b] = seqs[b][:n]
        proposed += int(result.num_proposed.sum())
        accepted += int(result.num_accepted.sum())
    return out, None, accepted / proposed if proposed else 0.0


def _continuous(model, work, compile, speculative: bool = False) -> tuple[dict[int, list[int]], int, float | None]:
    """-> (tokens per request, the target's forwards, the acceptance rate or None). Forwards: one a
    step (a speculative step's new prompts ride in its round's forwards), but for a
    ContinuousBatcher's last step, which only samples."""
    settings = dict(batch_size=BATCH, max_length=48 + 128, eos_token_id=[], compile=compile)
    batcher = (SpeculativeBatcher(model, speculate_k=K, **settings) if speculative
               else ContinuousBatcher(model, **settings))
    for prompt, limit in work:
        batcher.submit(prompt, max_new_tokens=limit)
    out, steps = {}, 0
    while batcher.waiting or batcher.running:
        out.update(batcher.step())
        steps += 1
    if speculative:
        return out, steps, batcher.acceptance_rate
    return out, steps - 1, None


def _left_padded(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt):] = torch.tensor(prompt)
        mask[b, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def run(h) -> None:
    cuda = h.device.type == "cuda"
    sizes = GPU_CONFIG if cuda else CPU_CONFIG
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**sizes)).to(torch.bfloat16 if cuda else torch.float32).to(h.device).eval()
    patch_model(model)
    work = _workload(8 if h.quick else 32, sizes["vocab_size"])
    # (name, its baseline, the way): each way against its baseline, decoding alike
    ways = [("generate (static batches)", None, lambda: _static(model, work, h.device, cuda)),
            ("ContinuousBatcher", "generate (static batches)", lambda: _continuous(model, work, cuda)),
            ("prompt_lookup_generate (static batches)", None, lambda: _static_lookup(model, work, h.device, cuda)),
            ("SpeculativeBatcher (prompt lookup)", "prompt_lookup_generate (static batches)",
             lambda: _continuous(model, work, cuda, speculative=True))]
    results = {}
    for name, _, way in ways:
        way()  # (warm-up: compiles on a GPU)
        best = None
        for _ in range(REPEATS):
            start = time.perf_counter()
            tokens, forwards, acceptance = way()
            if cuda:
                torch.cuda.synchronize(h.device)
            seconds = time.perf_counter() - start
            best = seconds if best is None else min(best, seconds)
        results[name] = (best, tokens, forwards, acceptance)
    greedy = results["generate (static batches)"][1]
    for name, (_, tokens, _, _) in results.items():
        if tokens != greedy:  # (greedy speculative decoding is exact: every way gives generate's tokens)
            raise RuntimeError(f"{name} gave other tokens than generate: not timed")
    made = sum(n for _, n in work)
    case = {"model": f"llama hidden {sizes['hidden_size']} x {sizes['num_hidden_layers']} layers",
            "requests": len(work), "batch_size": BATCH, "new_tokens": made}
    for name, baseline, _ in ways:
        seconds, _, forwards, acceptance = results[name]
        baseline = baseline or name
        h.rows.append({"op": "continuous", **case, "impl": name, "baseline": baseline, "seconds": seconds,
                       "tokens_per_s": made / seconds, "forwards": forwards,
                       **({"speculate_k": K, "acceptance_rate": acceptance} if acceptance is not None else {}),
                       "speedup_vs_baseline": results[baseline][0] / seconds,
                       "cudagraph_recorded_again_so_far": cuda_graph_records.recorded_again(), **h.meta})
    _chunked_prefill(h, model, sizes, cuda)
    _shared_prefix(h, model, sizes, cuda)


def _chunked_prefill(h, model, sizes, cuda) -> None:
    """Long prompts arriving among decoding requests: the longest step (what a running request waits
    for its next token) with whole prompts, and with prompts split into parts of max_prefill_tokens."""
    long, budget = (4096, 512) if cuda else (768, 96)
    g = torch.Generator().manual_seed(1)
    work = _workload(8 if h.quick else 24, sizes["vocab_size"])
    for i in range(2 if h.quick else 4):  # (every sixth request a long prompt)
        prompt = torch.randint(3, sizes["vocab_size"], (long,), generator=g).tolist()
        work.insert(6 * i + 3, (prompt, 16))
    results = {}
    for limit in (None, budget):
        def serve():
            batcher = ContinuousBatcher(model, batch_size=BATCH, max_length=long + 128, eos_token_id=[],
                                        compile=cuda, max_prefill_tokens=limit)
            for prompt, n in work:
                batcher.submit(prompt, max_new_tokens=n)
            out, steps = {}, []
            while batcher.waiting or batcher.running:
                start = time.perf_counter()
                out.update(batcher.step())
                if cuda:
                    torch.cuda.synchronize(h.device)
                steps.append(time.perf_counter() - start)
            return out, steps
        serve()  # (warm-up)
        start = time.perf_counter()
        tokens, steps = serve()
        results[limit] = (time.perf_counter() - start, tokens, sorted(steps))
    if results[None][1] != results[budget][1]:
        raise RuntimeError("chunked prefill gave other tokens than whole prompts: not timed")
    made = sum(n for _, n in work)
    base_seconds, _, base_steps = results[None]
    for limit, (seconds, _, steps) in results.items():
        h.rows.append({"op": "continuous-prefill", "model": f"llama hidden {sizes['hidden_size']} x "
                       f"{sizes['num_hidden_layers']} layers", "requests": len(work), "long_prompts": f"{long} tokens",
                       "batch_size": BATCH, "new_tokens": made,
                       "impl": "ContinuousBatcher" + (f" (max_prefill_tokens={limit})" if limit else ""),
                       "baseline": "ContinuousBatcher", "seconds": seconds, "tokens_per_s": made / seconds,
                       "steps": len(steps), "median_step_ms": steps[len(steps) // 2] * 1e3,
                       "longest_step_ms": steps[-1] * 1e3, "longest_step_vs_baseline": base_steps[-1] / steps[-1],
                       "speedup_vs_baseline": base_seconds / seconds,
                       "cudagraph_recorded_again_so_far": cuda_graph_records.recorded_again(), **h.meta})


def _shared_prefix(h, model, sizes, cuda) -> None:
    """Requests that begin with one system prompt (as a chat service's do): served with and without
    reuse_prefixes, which runs the system prompt's forward once instead of once per request."""
    system_length = 1024 if cuda else 256
    g = torch.Generator().manual_seed(2)
    system = torch.randint(3, sizes["vocab_size"], (system_length,), generator=g).tolist()
    work = [(system + prompt, limit) for prompt, limit in _workload(8 if h.quick else 32, sizes["vocab_size"])]
    results = {}
    for reuse in (False, True):
        def serve():
            batcher = ContinuousBatcher(model, batch_size=BATCH, max_length=system_length + 48 + 128, eos_token_id=[],
                                        compile=cuda, reuse_prefixes=reuse)
            for prompt, n in work:
                batcher.submit(prompt, max_new_tokens=n)
            return batcher.run(), batcher.reused_tokens
        serve()  # (warm-up)
        best = None
        for _ in range(REPEATS):
            start = time.perf_counter()
            tokens, reused = serve()
            if cuda:
                torch.cuda.synchronize(h.device)
            seconds = time.perf_counter() - start
            best = seconds if best is None else min(best, seconds)
        results[reuse] = (best, tokens, reused)
    if results[False][1] != results[True][1]:
        raise RuntimeError("prefix reuse gave other tokens than running every prompt: not timed")
    made = sum(n for _, n in work)
    prompt_tokens = sum(len(p) for p, _ in work)
    for reuse, (seconds, _, reused) in results.items():
        h.rows.append({"op": "continuous-prefix", "model": f"llama hidden {sizes['hidden_size']} x "
                       f"{sizes['num_hidden_layers']} layers", "requests": len(work),
                       "system_prompt": f"{system_length} tokens", "batch_size": BATCH, "new_tokens": made,
                       "impl": "ContinuousBatcher" + (" (reuse_prefixes)" if reuse else ""),
                       "baseline": "ContinuousBatcher", "seconds": seconds, "tokens_per_s": made / seconds,
                       "prompt_tokens_run": prompt_tokens - reused,
                       "speedup_vs_baseline": results[False][0] / seconds, **h.meta})
