"""ContinuousBatcher: more requests than rows, of different lengths and limits, ending at different
steps (eos or their own limit) so that new ones take the freed rows mid-batch: each greedy request
gets exactly the tokens generate gives its prompt alone (families with ring-buffer layers, ALiBi and
attention of their own included; int8 and compiled steps too); each request samples with its own
arguments; what it cannot serve is refused, naming the argument."""

import pytest
import torch

from gptfast_kernels import generate
from gptfast_kernels.generation import forward
from gptfast_kernels.generation.continuous import ContinuousBatcher
from python_tests.tiny_models import patched_copy, tiny_model

LENGTHS = (5, 9, 3, 7, 4, 6, 8)
LIMITS = (6, 3, 9, 4, 7, 5, 2)


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in LENGTHS]


def _alone(model, prompt, limit, eos, **kwargs):
    """generate's new tokens for one prompt alone, up to (and with) the eos that ended it."""
    new = generate(model, torch.tensor([prompt]), max_new_tokens=limit, eos_token_id=eos, **kwargs).sequences
    tokens = new[0, len(prompt):].tolist()
    return next((tokens[:i + 1] for i, t in enumerate(tokens) if t in eos), tokens)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3_text", "mistral", "bloom", "falcon", "xglm", "qwen3_moe"])
def test_every_request_gets_what_generate_gives_its_prompt_alone(family, monkeypatch):
    monkeypatch.setattr(forward, "PREFILL_CHUNK", 3)  # (ring-buffer layers of WINDOW + 2 slots: they wrap)
    model = patched_copy(tiny_model(family), int8=False)
    prompts = _prompts()
    eos = [_alone(model, prompts[1], 9, [])[1]]  # (a token some request makes: it ends early)
    batcher = ContinuousBatcher(model, batch_size=3, max_length=24, eos_token_id=eos)
    ids = [batcher.submit(p, max_new_tokens=n) for p, n in zip(prompts, LIMITS)]
    assert batcher.cache.has_ring_layers == (family in ("gemma3_text", "mistral"))
    steps, out = 0, {}
    while batcher.waiting or batcher.running:
        out.update(batcher.step())
        steps += 1
    assert steps < sum(LIMITS)  # (rows were shared: requests ran side by side)
    for request, prompt, limit in zip(ids, prompts, LIMITS):
        assert out[request] == _alone(model, prompt, limit, eos), (family, request)
    assert any(out[r][-1] == eos[0] and len(out[r]) < n for r, n in zip(ids, LIMITS))  # (an eos ended one)


def test_int8_and_compiled_steps_give_the_eager_tokens():
    model = patched_copy(tiny_model("llama", layers=3), int8=True)
    prompts = _prompts(1)
    runs = []
    for compile in (False, True):
        batcher = ContinuousBatcher(model, batch_size=2, max_length=20, eos_token_id=[], compile=compile)
        for p, n in zip(prompts, LIMITS):
            batcher.submit(p, max_new_tokens=n)
        runs.append(batcher.run())
    assert runs[0] == runs[1]
    assert runs[0] == {i: _alone(model, p, n, []) for i, (p, n) in enumerate(zip(prompts, LIMITS))}


def test_each_request_samples_with_its_own_arguments():
    model = patched_copy(tiny_model("llama", layers=2), int8=False)
    prompts = _prompts(2)
    batcher = ContinuousBatcher(model, batch_size=3, max_length=24, eos_token_id=[],
                                generator=torch.Generator().manual_seed(0))
    settings = [dict(), dict(temperature=0.9, top_k=1), dict(temperature=1.5), dict(temperature=0.7, top_p=0.9),
                dict(), dict(temperature=2.0, min_p=0.1), dict(temperature=1.0, top_k=1)]
    for p, n, s in zip(prompts, LIMITS, settings):
        batcher.submit(p, max_new_tokens=n, **s)
    out = batcher.run()
    for i, (p, n, s) in enumerate(zip(prompts, LIMITS, settings)):
        greedy = _alone(model, p, n, [])
        if not s or s.get("top_k") == 1:  # greedy, or sampling from the top token alone
            assert out[i] == greedy, (i, s)
        assert len(out[i]) == n and all(0 <= t < 97 for t in out[i])
    assert any(out[i] != _alone(model, p, n, []) for i, (p, n) in enumerate(zip(prompts, LIMITS)) if i in (2, 5))


def test_what_it_cannot_serve_is_refused():
    model = patched_copy(tiny_model("llama"), int8=False)
    batcher = ContinuousBatcher(model, batch_size=2, max_length=10)
    with pytest.raises(ValueError, match="max_length"):
        batcher.submit([3] * 8, max_new_tokens=4)  # 11 slots
    with pytest.raises(ValueError, match="prompt_ids"):
        batcher.submit([], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt_ids"):
        batcher.submit([3, 97], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt_ids"):
        batcher.submit(torch.ones(2, 2, dtype=torch.int64), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        batcher.submit([3], max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        batcher.submit([3], max_new_tokens=2, temperature=-1.0)
    with pytest.raises(ValueError, match="batch_size"):
        ContinuousBatcher(model, batch_size=0)
    with pytest.raises(ValueError, match="not patched"):
        ContinuousBatcher(tiny_model("llama"))
    with pytest.raises(ValueError, match="hybrid"):
        ContinuousBatcher(patched_copy(tiny_model("qwen3_5_text"), int8=False), batch_size=2, max_length=8)
    assert batcher.run() == {} and not batcher.waiting  # (nothing was queued by the refusals)
