"""Bad inputs for patch_model, StaticKVCache, generate and speculative_generate, each run in a child
process (see isolated.py): each must raise ValueError/TypeError naming the argument."""

from __future__ import annotations

import torch

from python_tests.reliability.op_cases import Case


def _models(int8=False):
    from gptfast_kernels import patch_model
    from python_tests.tiny_models import patched_copy, tiny_model

    target = tiny_model("llama")
    return target, patched_copy(target, int8=int8), patch_model(tiny_model("llama", layers=1, seed=3), int8=int8)


def _generate(**overrides):
    def run():
        from gptfast_kernels import generate

        _, patched, _ = _models()
        args = dict(input_ids=torch.tensor([[2, 3, 4], [5, 6, 7]]), attention_mask=None, max_new_tokens=4)
        args.update({k: (v() if callable(v) else v) for k, v in overrides.items()})
        return generate(patched, **args)
    return run


def _speculative(**overrides):
    def run():
        from gptfast_kernels import speculative_generate

        _, patched, draft = _models()
        args = dict(model=patched, draft_model=draft, input_ids=torch.tensor([[2, 3, 4]]), max_new_tokens=4)
        args.update({k: (v() if callable(v) else v) for k, v in overrides.items()})
        return speculative_generate(**args)
    return run


def _batcher_prompt_past_vocab():
    from gptfast_kernels import ContinuousBatcher

    _, patched, _ = _models()
    ContinuousBatcher(patched, batch_size=2, max_length=8).submit([2, 97], max_new_tokens=2)


def _speculative_batcher(**overrides):
    def run():
        from gptfast_kernels import SpeculativeBatcher

        _, patched, draft = _models()
        args = dict(draft_model=draft, batch_size=2, max_length=8)
        args.update({k: (v() if callable(v) else v) for k, v in overrides.items()})
        submit = args.pop("submit", dict(prompt_ids=[2, 3], max_new_tokens=2))
        batcher = SpeculativeBatcher(patched, **args)
        batcher.submit(**submit)
        return batcher.run()
    return run


def _copy_prefix(source, target, length):
    def run():
        from gptfast_kernels import StaticKVCache

        _, patched, _ = _models()
        cache = StaticKVCache(patched.config, 2, 8)
        patched(torch.tensor([[2, 3, 4], [5, 6, 7]]), past_key_values=cache)
        cache.copy_prefix(source, target, length)
    return run


def _stop_strings_without_a_tokenizer():
    from gptfast_kernels import prompt_lookup_generate

    _, patched, _ = _models()
    prompt_lookup_generate(patched, torch.tensor([[2, 3, 4]]), max_new_tokens=2, stop_strings=["x"])


def _patch_unsupported():
    from transformers import AutoModelForCausalLM, BertConfig

    from gptfast_kernels import patch_model

    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        vocab_size=50, is_decoder=True)
    patch_model(AutoModelForCausalLM.from_config(config))


def _full_cache():
    from gptfast_kernels import StaticKVCache

    _, patched, _ = _models()
    cache = StaticKVCache(patched.config, 1, 4)
    before = cache.layers[0].keys.clone()
    try:
        patched(torch.tensor([[2, 3, 4, 5, 6]]), past_key_values=cache)
    finally:
        if not torch.equal(before, cache.layers[0].keys) or cache.get_seq_length() != 0:
            raise AssertionError("a refused forward modified the cache")


def _cache_batch_mismatch():
    from gptfast_kernels import StaticKVCache

    _, patched, _ = _models()
    patched(torch.tensor([[2, 3]]), past_key_values=StaticKVCache(patched.config, 3, 4))


def _short_cache():
    from gptfast_kernels import StaticKVCache, generate

    _, patched, _ = _models()
    generate(patched, torch.tensor([[2, 3]]), max_new_tokens=10, past_key_values=StaticKVCache(patched.config, 1, 5))


CASES: dict[str, Case] = {
    "patch_not_a_model": Case(lambda: __import__("gptfast_kernels").patch_model(object()), "model", (TypeError,)),
    "patch_unsupported_family": Case(_patch_unsupported, "supported model families"),
    "cache_full": Case(_full_cache, "max_cache_len"),
    "cache_batch_mismatch": Case(_cache_batch_mismatch, "batch_size"),
    "cache_too_short_for_max_new_tokens": Case(_short_cache, "max_cache_len"),
    "generate_unpatched": Case(lambda: __import__("gptfast_kernels").generate(_models()[0], torch.tensor([[2]]),
                                                                             max_new_tokens=2), "patch_model"),
    "generate_ids_float": Case(_generate(input_ids=lambda: torch.ones(2, 3)), "input_ids"),
    "generate_ids_too_big": Case(_generate(input_ids=lambda: torch.tensor([[2, 3, 97], [5, 6, 7]])), "input_ids"),
    "generate_ids_negative": Case(_generate(input_ids=lambda: torch.tensor([[2, -1, 4], [5, 6, 7]])), "input_ids"),
    "generate_empty_batch": Case(_generate(input_ids=lambda: torch.zeros(0, 3, dtype=torch.int64)), "input_ids"),
    "generate_mask_shape": Case(_generate(attention_mask=lambda: torch.ones(2, 2)), "attention_mask"),
    "generate_mask_all_padding_row": Case(_generate(attention_mask=lambda: torch.tensor([[1, 1, 1], [0, 0, 0]])),
                                          "attention_mask"),
    "generate_negative_new_tokens": Case(_generate(max_new_tokens=-1), "max_new_tokens"),
    "generate_nan_temperature": Case(_generate(temperature=float("nan")), "temperature"),
    # ints no float holds (math.isfinite raised OverflowError on them)
    "generate_int_past_float_temperature": Case(_generate(temperature=10**400), "temperature"),
    "spec_int_past_float_presence_penalty": Case(_speculative(presence_penalty=10**400), "presence_penalty"),
    "spec_int_past_float_repetition_penalty": Case(_speculative(repetition_penalty=-10**400), "repetition_penalty"),
    "generate_top_p_zero": Case(_generate(temperature=1.0, top_p=0.0), "top_p"),
    "generate_min_p_above_one": Case(_generate(temperature=1.0, min_p=1.5), "min_p"),
    "spec_min_p_negative": Case(_speculative(temperature=1.0, min_p=-0.5), "min_p"),
    "spec_k_zero": Case(_speculative(speculate_k=0), "speculate_k"),
    "spec_vocab_mismatch": Case(_speculative(draft_model=lambda: __import__("gptfast_kernels").patch_model(
        __import__("python_tests.tiny_models", fromlist=["x"]).tiny_model("llama", vocab=40))), "vocabulary"),
    "spec_draft_unpatched": Case(_speculative(draft_model=lambda: _models()[0]), "draft_model"),
    "spec_ids_too_big": Case(_speculative(input_ids=lambda: torch.tensor([[2, 300]])), "input_ids"),
    "spec_negative_temperature": Case(_speculative(temperature=-1.0), "temperature"),
    "generate_stop_token_past_vocab": Case(_generate(stop_sequences=[[3, 97]]), "stop_sequences"),
    "spec_nan_presence_penalty": Case(_speculative(presence_penalty=float("nan")), "presence_penalty"),
    "generate_nan_temperature_of_one_row": Case(_generate(temperature=[0.5, float("nan")]), "temperature[1]"),
    "spec_max_new_tokens_per_row_too_many": Case(_speculative(max_new_tokens=[2, 3]), "max_new_tokens"),
    "generate_top_k_tensor_2d": Case(_generate(temperature=1.0, top_k=lambda: torch.ones(2, 1, dtype=torch.int64)),
                                     "top_k"),
    "prompt_lookup_stop_strings_without_tokenizer": Case(_stop_strings_without_a_tokenizer, "tokenizer"),
    "batcher_prompt_past_vocab": Case(_batcher_prompt_past_vocab, "prompt_ids"),
    "batcher_max_prefill_tokens_zero": Case(lambda: __import__("gptfast_kernels").ContinuousBatcher(
        _models()[1], batch_size=2, max_length=8, max_prefill_tokens=0), "max_prefill_tokens"),
    "copy_prefix_row_out_of_range": Case(_copy_prefix(0, 2, 1), "target"),
    "copy_prefix_longer_than_source": Case(_copy_prefix(0, 1, 4), "length"),
    "batcher_reuse_prefixes_not_a_flag": Case(lambda: __import__("gptfast_kernels").ContinuousBatcher(
        _models()[1], batch_size=2, max_length=8, reuse_prefixes=1), "reuse_prefixes"),
    "speculative_batcher_k_zero": Case(_speculative_batcher(speculate_k=0), "speculate_k"),
    "speculative_batcher_ngram_zero": Case(_speculative_batcher(draft_model=None, max_ngram_size=0), "max_ngram_size"),
    "speculative_batcher_draft_unpatched": Case(_speculative_batcher(draft_model=lambda: _models()[0]), "draft_model"),
    "speculative_batcher_past_max_length": Case(_speculative_batcher(
        submit=dict(prompt_ids=[2, 3, 4, 5, 6], max_new_tokens=5)), "max_length"),
    "speculative_batcher_nan_top_p": Case(_speculative_batcher(
        submit=dict(prompt_ids=[2, 3], max_new_tokens=2, temperature=1.0, top_p=float("nan"))), "top_p"),
}
