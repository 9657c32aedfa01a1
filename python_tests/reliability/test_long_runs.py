"""Long runs: 1,000 decode steps and 200 speculative rounds on tiny models with no growth in
memory. A leak shows up as live tensors left behind (counted after garbage collection) or as
resident memory that keeps growing from one long run to the next; both are checked."""

import gc
import os
import warnings
import weakref

import torch

from gptfast_kernels import generate, patch_model, speculative_generate
from python_tests.tiny_models import patched_copy, tiny_model

# Resident-memory growth allowed between two identical long runs: allocator noise, not a leak
# (a leak of one logits row per step would be 1000 x 32000 x 4 bytes = 128 MB here).
RSS_SLACK_BYTES = 24 << 20


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _live_tensors() -> list[torch.Tensor]:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on some deprecated torch objects warns
        warnings.simplefilter("ignore")
        return [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]


def _check_no_growth(run):
    run()  # warm-up: lazily created state, allocator pools
    before = {id(tensor): weakref.ref(tensor) for tensor in _live_tensors()}
    rss = _rss_bytes()
    run()
    # every tensor alive now was alive before the run (the same object): the run left none of its own
    # behind (counting them would not do: a run may also release state an earlier test left)
    left = [tensor for tensor in _live_tensors() if id(tensor) not in before or before[id(tensor)]() is not tensor]
    assert not left, f"{len(left)} tensors were left alive by a finished run: {[t.shape for t in left[:5]]}"
    del left
    run()
    assert _rss_bytes() - rss < RSS_SLACK_BYTES, f"resident memory grew by {(_rss_bytes() - rss) >> 20} MiB"


def test_thousand_decode_steps_without_growth():
    patched = patched_copy(tiny_model("llama", vocab=32000), int8=True)
    ids = torch.tensor([[5, 6, 7, 8]])

    def run():
        out = generate(patched, ids, max_new_tokens=1000, eos_token_id=[])
        assert out.sequences.shape == (1, 1004)

    _check_no_growth(run)


def test_two_hundred_speculative_rounds_without_growth():
    target = patched_copy(tiny_model("gpt2", vocab=4000), int8=True)
    draft = patch_model(tiny_model("gpt2", vocab=4000, layers=1, seed=5), int8=True)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])

    def run():
        out = speculative_generate(target, draft, ids, max_new_tokens=200, speculate_k=2, eos_token_id=[])
        assert out.sequences.shape == (2, 203)
        # an unrelated draft is mostly rejected: about one round per token, ~200 rounds
        assert int(out.num_proposed.max()) >= 2 * 150

    _check_no_growth(run)
