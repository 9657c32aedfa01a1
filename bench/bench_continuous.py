"""Continuous batching against static batches: the same requests (random prompts of 8 to 48 tokens,
half of them asking for few new tokens and half for many, as a chat workload mixes short and long
answers; greedy, no eos, so each makes exactly its max_new_tokens) served by ``ContinuousBatcher``
(a freed row takes the next request at once) and by ``generate`` over consecutive batches of the
same size (each row stops at its own limit, the batch runs until its longest row). Both must give
every request the same tokens; a row gives the wall seconds for all requests (the faster of two
runs, after a warm-up), the tokens per second and the number of model forwards.

CPU: a small Llama (hidden 256, 4 layers) in float32, eager. GPU: Llama-3.2-1B's shapes in bfloat16,
compiled decode steps (CUDA graphs). int8 weights either way.
"""

from __future__ import annotations

import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gptfast_kernels import ContinuousBatcher, generate, patch_model

CPU_CONFIG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=4096, max_position_embeddings=1024)
GPU_CONFIG = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096, tie_word_embeddings=True)
BATCH = 8
REPEATS = 2


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


def _static(model, work, device, compile) -> tuple[dict[int, list[int]], int]:
    """generate over consecutive batches -> (tokens per request, forwards: a prefill and the decode
    steps of each batch)."""
    out, forwards = {}, 0
    for start in range(0, len(work), BATCH):
        chunk = work[start:start + BATCH]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.int64)
        mask = torch.zeros(len(chunk), width, dtype=torch.int64)
        for b, (prompt, _) in enumerate(chunk):
            ids[b, width - len(prompt):] = torch.tensor(prompt)
            mask[b, width - len(prompt):] = 1
        limits = [n for _, n in chunk]
        seqs = generate(model, ids.to(device), mask.to(device), max_new_tokens=limits, eos_token_id=[],
                        compile=compile).sequences[:, width:].tolist()
        for b, n in enumerate(limits):
            out[start + b] = seqs[b][:n]
        forwards += max(limits)
    return out, forwards


def _continuous(model, work, compile) -> tuple[dict[int, list[int]], int]:
    batcher = ContinuousBatcher(model, batch_size=BATCH, max_length=48 + 128, eos_token_id=[], compile=compile)
    for prompt, limit in work:
        batcher.submit(prompt, max_new_tokens=limit)
    out, steps = {}, 0
    while batcher.waiting or batcher.running:
        out.update(batcher.step())
        steps += 1
    return out, steps - 1  # (one forward a step, but for the last, which only samples)


def run(h) -> None:
    cuda = h.device.type == "cuda"
    sizes = GPU_CONFIG if cuda else CPU_CONFIG
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**sizes)).to(torch.bfloat16 if cuda else torch.float32).to(h.device).eval()
    patch_model(model)
    work = _workload(8 if h.quick else 32, sizes["vocab_size"])
    ways = {"generate (static batches)": lambda: _static(model, work, h.device, cuda),
            "ContinuousBatcher": lambda: _continuous(model, work, cuda)}
    results = {}
    for name, way in ways.items():
        way()  # (warm-up: compiles on a GPU)
        best = None
        for _ in range(REPEATS):
            start = time.perf_counter()
            tokens, forwards = way()
            if cuda:
                torch.cuda.synchronize(h.device)
            seconds = time.perf_counter() - start
            best = seconds if best is None else min(best, seconds)
        results[name] = (best, tokens, forwards)
    base_seconds, base_tokens, _ = results["generate (static batches)"]
    if results["ContinuousBatcher"][1] != base_tokens:
        raise RuntimeError("continuous batching gave other tokens than generate: not timed")
    made = sum(n for _, n in work)
    case = {"model": f"llama hidden {sizes['hidden_size']} x {sizes['num_hidden_layers']} layers", "requests": len(work),
            "batch_size": BATCH, "new_tokens": made}
    for name, (seconds, _, forwards) in results.items():
        h.rows.append({"op": "continuous", **case, "impl": name, "baseline": "generate (static batches)",
                       "seconds": seconds, "tokens_per_s": made / seconds, "forwards": forwards,
                       "speedup_vs_baseline": base_seconds / seconds, **h.meta})
