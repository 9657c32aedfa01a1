"""Property-based tests: every op's CPU kernel and Triton kernel (interpreter) against its reference
over random shapes, dtypes, GQA ratios, ragged positions and vocabularies. Example counts are
bounded so the suite stays fast; hypothesis' database is off so runs are reproducible."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gptfast_kernels import ops
from gptfast_kernels.ops import reference
from python_tests.backends import kernel_backends

EXAMPLES = {"cpu": 30, "triton": 8}  # the interpreter is ~100x slower than the CPU kernel
DTYPE_TOL = {torch.float32: (1e-3, 1e-4), torch.float16: (5e-2, 2e-3), torch.bfloat16: (2e-1, 1.6e-2)}
dtypes = st.sampled_from(list(DTYPE_TOL))


def _settings(backend):
    return settings(max_examples=EXAMPLES[backend], deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("backend, device", kernel_backends("int8_linear")[:2])
def test_int8_linear_property(backend, device):
    @_settings(backend)
    @given(M=st.integers(0, 40), N=st.integers(1, 70), K=st.integers(1, 300), dtype=dtypes,
           with_bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
    def check(M, N, K, dtype, with_bias, seed):
        g = torch.Generator().manual_seed(seed)
        qweight, scales = ops.quantize_int8(torch.randn(N, K, generator=g).to(dtype))
        x = torch.randn(M, K, generator=g).to(dtype)
        bias = torch.randn(N, generator=g).to(dtype) if with_bias else None
        y = ops.int8_linear(x, qweight, scales, bias, backend=backend)
        expected = reference.int8_linear(x.double(), qweight, scales, None if bias is None else bias.double())
        atol, rtol = DTYPE_TOL[dtype]
        torch.testing.assert_close(y.double(), expected, atol=atol * max(1.0, K / 200), rtol=rtol)

    check()


def _attention_case(g, B, Hkv, group, T, D, S, dtype):
    Hq = Hkv * group
    q = torch.randn(B, Hq, T, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    k_cache = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v_cache = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    # per row: a start in [0, S - T], consecutive slots, some tokens turned into padding (-1)
    starts = torch.randint(0, S - T + 1, (B, 1), generator=g)
    positions = starts + torch.arange(T)
    padding = torch.rand(B, T, generator=g) < 0.2
    positions = torch.where(padding, torch.full_like(positions, -1), positions)
    return q, k, v, k_cache, v_cache, positions


@pytest.mark.parametrize("backend, device", kernel_backends("kv_cache_attention")[:2])
def test_kv_cache_attention_property(backend, device):
    @_settings(backend)
    @given(B=st.integers(1, 3), Hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
           T=st.integers(1, 6), D=st.sampled_from([16, 32, 64, 80]), extra=st.integers(0, 20),
           dtype=dtypes, chunk=st.sampled_from([None, 1, 3, 8]), seed=st.integers(0, 2**31 - 1))
    def check(B, Hkv, group, T, D, extra, dtype, chunk, seed):
        g = torch.Generator().manual_seed(seed)
        S = T + extra
        q, k, v, k_cache, v_cache, positions = _attention_case(g, B, Hkv, group, T, D, S, dtype)
        ref_k, ref_v = k_cache.double(), v_cache.double()
        expected = reference.kv_cache_attention(q.double(), k.double(), v.double(), ref_k, ref_v, positions,
                                                chunk_size=chunk)
        out = ops.kv_cache_attention(q, k, v, k_cache, v_cache, positions, chunk_size=chunk, backend=backend)
        # tolerance: a low-precision PyTorch computation's own error, doubled, plus a floor
        low = reference.kv_cache_attention(q, k, v, k_cache.clone(), v_cache.clone(), positions, chunk_size=chunk)
        budget = 2 * (low.double() - expected).abs().max().item() + DTYPE_TOL[dtype][0] / 10
        assert (out.double() - expected).abs().max().item() <= budget
        torch.testing.assert_close(k_cache.double(), ref_k, atol=0, rtol=0)
        torch.testing.assert_close(v_cache.double(), ref_v, atol=0, rtol=0)

    check()


@pytest.mark.parametrize("backend, device", kernel_backends("verify_draft")[:2])
def test_verify_draft_property(backend, device):
    @_settings(backend)
    @given(B=st.integers(1, 6), k=st.integers(1, 6), V=st.integers(2, 300), greedy=st.booleans(),
           peaked=st.booleans(), seed=st.integers(0, 2**31 - 1))
    def check(B, k, V, greedy, peaked, seed):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(B, k + 1, V, generator=g) * (8 if peaked else 1)
        target = torch.softmax(logits, -1)
        draft = None if greedy else torch.softmax(torch.randn(B, k, V, generator=g), -1)
        # half the draft tokens copy the target's argmax so acceptance is not always zero
        tokens = torch.where(torch.rand(B, k, generator=g) < 0.5, target[:, :k].argmax(-1),
                             torch.randint(0, V, (B, k), generator=g))
        uniforms = torch.rand(B, k + 1, generator=g)
        out_tokens, num = ops.verify_draft(target, draft, tokens, uniforms, backend=backend)
        ref_tokens, ref_num = reference.verify_draft(target, draft, tokens, uniforms)
        assert torch.equal(num, ref_num)
        # Exact agreement: a different summation order could only flip the emitted token when
        # u * total lands within rounding of a partial sum, which these fixed examples avoid.
        assert torch.equal(out_tokens, ref_tokens)

    check()


@pytest.mark.parametrize("kind", ["continuous", "continuous-compiled", "speculative-draft", "speculative-lookup"])
def test_batchers_serve_random_workloads_as_generate(kind):
    """Random workloads through a batcher (compiled steps too: one call each once every running
    prompt is in): rows 1 to 4, 3 to 9 requests of random prompts (1 to 12 tokens, some beginning
    with a shared start) and limits, a random eos, chunked prefill or not, prefix reuse or not, some
    requests cancelled at random steps and new ones submitted between steps. Every request that ran
    to its end gets generate's tokens for its prompt alone; a cancelled one a prefix of them."""
    from gptfast_kernels import ContinuousBatcher, SpeculativeBatcher, generate
    from python_tests.tiny_models import draft_of, patched_copy, tiny_model

    target = tiny_model("llama", layers=2)
    model = patched_copy(target, int8=False)
    draft = patched_copy(draft_of(target), int8=False)
    alone, reused = {}, []

    def generated(prompt, limit, eos):
        key = (tuple(prompt), limit, tuple(eos))
        if key not in alone:
            out = generate(model, torch.tensor([prompt]), max_new_tokens=limit, eos_token_id=eos).sequences
            tokens = out[0, len(prompt):].tolist()
            alone[key] = next((tokens[:i + 1] for i, t in enumerate(tokens) if t in eos), tokens)
        return alone[key]

    @settings(max_examples=6, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(rows=st.integers(1, 4), seed=st.integers(0, 2**31 - 1), budget=st.sampled_from([None, 1, 3, 7]),
           eos=st.integers(3, 96), k=st.integers(1, 4), reuse=st.booleans())
    def check(rows, seed, budget, eos, k, reuse):
        g = torch.Generator().manual_seed(seed)
        settings_ = dict(batch_size=rows, max_length=24, eos_token_id=[eos], max_prefill_tokens=budget,
                         reuse_prefixes=reuse)
        shared = torch.randint(3, 97, (int(torch.randint(0, 7, (), generator=g)),), generator=g).tolist()
        batcher = (ContinuousBatcher(model, compile=kind == "continuous-compiled", **settings_)
                   if kind.startswith("continuous") else
                   SpeculativeBatcher(model, draft if kind == "speculative-draft" else None, speculate_k=k,
                                      **settings_))
        requests, cancelled, out = {}, {}, {}

        def submit():
            own = torch.randint(3, 97, (int(torch.randint(1, 7, (), generator=g)),), generator=g).tolist()
            prompt = (shared if bool(torch.randint(0, 2, (), generator=g)) else []) + own  # (some share a start)
            limit = int(torch.randint(1, 12, (), generator=g))
            requests[batcher.submit(prompt, max_new_tokens=limit)] = (prompt, limit)

        for _ in range(int(torch.randint(3, 7, (), generator=g))):
            submit()
        steps = 0
        while batcher.waiting or batcher.running:
            out.update(batcher.step())
            steps += 1
            chance = int(torch.randint(0, 10, (), generator=g))
            live = [r.id for r in batcher.rows if r is not None] + [r.id for r in batcher.waiting]
            if chance == 0 and live:
                victim = live[int(torch.randint(0, len(live), (), generator=g))]
                cancelled[victim] = batcher.cancel(victim)
            elif chance == 1 and len(requests) < 9:
                submit()
            assert steps < 400
        assert set(out) | set(cancelled) == set(requests) and not set(out) & set(cancelled)
        reused.append(batcher.reused_tokens)
        for request, (prompt, limit) in requests.items():
            want = generated(prompt, limit, [eos])
            if request in out:
                assert out[request] == want, (request, prompt, limit)
            else:
                assert cancelled[request] == want[:len(cancelled[request])], (request, prompt, limit)

    check()
    assert sum(reused) > 0  # (some examples reused shared starts)


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_speculative_generators_equal_generate_on_random_batches(family):
    """Random batches (1 to 4 rows, prompts of 1 to 10 tokens padded left or right, a limit per row
    or one for all, k from 1 to 5; as eos none, or a token some row generates, so that rows end
    early; stop sequences or none): greedy
    speculative_generate (a one-layer draft; two for a hybrid) and prompt_lookup_generate return
    exactly generate's sequences, their width included (a round that carries a short row past its
    limit while the longest-limit row ends early must not widen the output)."""
    from gptfast_kernels import generate, prompt_lookup_generate, speculative_generate
    from python_tests.tiny_models import HYBRID, draft_of, patched_copy, tiny_model

    target = tiny_model(family)
    model = patched_copy(target, int8=False)
    draft = patched_copy(draft_of(target, 2 if target.config.model_type in HYBRID else 1), int8=False)

    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(lengths=st.lists(st.integers(1, 10), min_size=1, max_size=4), left=st.booleans(),
           limits=st.one_of(st.integers(1, 9), st.lists(st.integers(1, 9), min_size=4, max_size=4)),
           eos=st.one_of(st.none(), st.tuples(st.integers(0, 3), st.integers(0, 8))), stops=st.booleans(),
           k=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
    def check(lengths, left, limits, eos, stops, k, seed):
        g = torch.Generator().manual_seed(seed)
        B, P = len(lengths), max(lengths)
        ids, mask = torch.zeros(B, P, dtype=torch.int64), torch.zeros(B, P, dtype=torch.int64)
        for b, n in enumerate(lengths):
            columns = slice(P - n, P) if left else slice(0, n)
            ids[b, columns], mask[b, columns] = torch.randint(3, 90, (n,), generator=g), 1
        if eos is not None:  # (the token at (row, step) of the batch's own output without one)
            free = generate(model, ids, mask, max_new_tokens=9, eos_token_id=[]).sequences
            eos = int(free[eos[0] % B, P + eos[1]])
        options = dict(max_new_tokens=limits if isinstance(limits, int) else limits[:B],
                       eos_token_id=[] if eos is None else [eos],
                       stop_sequences=torch.randint(3, 90, (2, 1), generator=g).tolist() if stops else None)
        want = generate(model, ids, mask, **options).sequences
        got = speculative_generate(model, draft, ids, mask, speculate_k=k, **options).sequences
        assert torch.equal(got, want), ("speculative", got[:, P:].tolist(), want[:, P:].tolist())
        got = prompt_lookup_generate(model, ids, mask, speculate_k=k, **options).sequences
        assert torch.equal(got, want), ("prompt_lookup", got[:, P:].tolist(), want[:, P:].tolist())

    with torch.no_grad():
        check()
