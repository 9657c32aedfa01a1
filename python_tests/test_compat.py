"""gptfast_kernels.compat: GPTFast's API end to end on tiny Llama checkpoints saved to a temp dir
(no downloads). Greedy outputs are checked against transformers' own greedy decoding of the
unpatched target (int8 off) or against our ``generate`` on the same patched model (int8 on)."""

import copy
import io
import os

import pytest
import torch

pytest.importorskip("transformers")
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from gptfast_kernels import Int8Linear, generate  # noqa: E402
from gptfast_kernels import compat  # noqa: E402

VOCAB = 64
PAD, EOS = 0, 1


def _llama(layers, hidden, heads, vocab=VOCAB):
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         max_position_embeddings=256, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger logits than the default init: argmax far from ties
        model.lm_head.weight.mul_(20)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat")
    torch.manual_seed(0)
    paths = {}
    for name, model in (("target", _llama(2, 64, 4)), ("draft", _llama(1, 32, 2)),
                        ("other_vocab", _llama(1, 32, 2, vocab=VOCAB + 8))):
        paths[name] = str(root / name)
        model.save_pretrained(paths[name])
    words = {"<pad>": PAD, "<eos>": EOS, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(paths["target"])
    return paths


def _hf_greedy(path, input_ids, new_tokens, attention_mask=None):
    """transformers' greedy decoding of the unpatched checkpoint, not stopping at eos (as GPTFast)."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    model.generation_config.eos_token_id = None
    return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=PAD)


def _prompts(batch, length):
    return torch.randint(3, VOCAB, (batch, length))


@pytest.mark.parametrize("speculate_k", [1, 4])
def test_gpt_fast_greedy_equals_transformers_greedy(checkpoints, speculate_k):
    model = compat.gpt_fast(checkpoints["target"], checkpoints["draft"], int8=False, device="cpu")
    cur = _prompts(1, 5)
    out = model.generate(cur, 5 + 20, speculate_k)
    assert out.shape == (1, 25) and out.dtype == torch.int64
    torch.testing.assert_close(out, _hf_greedy(checkpoints["target"], cur, 20), rtol=0, atol=0)
    assert model.last_output.num_proposed.sum() > 0


def test_gpt_fast_batch_with_left_padding(checkpoints):
    model = compat.gpt_fast(checkpoints["target"], checkpoints["draft"], int8=False, device="cpu")
    cur = _prompts(3, 6)
    mask = torch.ones_like(cur)
    mask[1, :2] = 0
    mask[2, :4] = 0
    cur[mask == 0] = PAD
    out = model.generate(cur, 6 + 12, 3, attention_mask=mask)
    for row in range(3):  # each row as transformers decodes it alone, without its padding
        alone = cur[row:row + 1, int((mask[row] == 0).sum()):]
        expected = _hf_greedy(checkpoints["target"], alone, 12)
        torch.testing.assert_close(out[row, 6:], expected[0, alone.shape[1]:], rtol=0, atol=0)


def test_gpt_fast_int8_equals_own_greedy(checkpoints):
    model = compat.gpt_fast(checkpoints["target"], checkpoints["draft"], device="cpu")
    for name, wrapped in (("model", model.model), ("draft_model", model.draft_model)):
        assert any(isinstance(m, Int8Linear) for m in wrapped.model.modules()), name
    cur = _prompts(2, 4)
    out = model.generate(cur, 4 + 16, 4)
    expected = generate(model.model.model, cur, max_new_tokens=16, eos_token_id=[]).sequences
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def _argmax(self, probabilities):  # GPTFast's README sampler: bound to the model, returns a (1, 1) tensor
    return torch.argmax(probabilities, dim=-1).view(1, 1)


def _runner_up(self, probabilities, rank=1):  # a deterministic sampler that is not greedy
    return torch.topk(probabilities, rank + 1).indices[rank].item()


def _decode_alone_with(path, cur, new_tokens, pick):
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokens = cur.clone()
    with torch.no_grad():
        for _ in range(new_tokens):
            probs = torch.softmax(model(tokens).logits[0, -1].float(), -1)
            tokens = torch.cat([tokens, torch.tensor([[pick(probs)]])], dim=1)
    return tokens


def test_sample_function_argmax_equals_greedy(checkpoints):
    """Called as in GPTFast's README (keywords, and its max_length / cache_config, which we do not need)."""
    cur = _prompts(1, 5)
    model = compat.gpt_fast(checkpoints["target"], sample_function=_argmax, max_length=60, cache_config={},
                            draft_model_name=checkpoints["draft"], int8=False, device="cpu")
    out = model.generate(cur_tokens=cur, max_tokens=20, speculate_k=4)
    torch.testing.assert_close(out, _hf_greedy(checkpoints["target"], cur, 15), rtol=0, atol=0)


@pytest.mark.parametrize("draft", [True, False])
def test_sample_function_is_followed_exactly(checkpoints, draft):
    """A sampler that picks the second most likely token: output = decoding the target alone with it."""
    cur = _prompts(1, 4)
    model = compat.gpt_fast(checkpoints["target"], checkpoints["draft"] if draft else None, _runner_up,
                            int8=False, device="cpu")
    out = model.generate(cur, 4 + 10, 3, rank=1)  # sampling kwargs go to the sampler
    expected = _decode_alone_with(checkpoints["target"], cur, 10, lambda p: _runner_up(None, p, rank=1))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_sampling_kwargs_without_sample_function(checkpoints):
    model = compat.gpt_fast(checkpoints["target"], checkpoints["draft"], device="cpu")
    out = model.generate(_prompts(2, 3), 15, 3, temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(1))
    assert out.shape == (2, 15) and int(out.min()) >= 0 and int(out.max()) < VOCAB
    stopped = model.generate(_prompts(2, 3), 40, 3, eos_token_id=list(range(VOCAB)))  # every token ends a row
    assert stopped.shape == (2, 40) and bool((stopped[:, 4:] == PAD).all())
    # the penalties, min_new_tokens and stop sequences reach our generators: as generate with them, padded
    # to max_tokens (GPTFast's length) once every row has stopped
    cur = _prompts(2, 4)
    options = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5, min_new_tokens=3)
    free = model.generate(cur, 24, 3, **options)
    options["stop_sequences"] = [free[0, 6:8].tolist(), [int(free[1, 9])]]
    want = generate(model.model.model, cur, max_new_tokens=20, eos_token_id=[], **options).sequences
    assert want.shape[1] < 24  # (both rows stopped)
    got = model.generate(cur, 24, 3, **options)
    assert torch.equal(got[:, :want.shape[1]], want) and bool((got[:, want.shape[1]:] == PAD).all())
    assert not torch.equal(free, model.generate(cur, 24, 3))  # (the penalties acted)


def test_load_int8(checkpoints):
    model = compat.load_int8(checkpoints["target"], device="cpu")
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    # q + k + v (one Int8FusedProjections matmul), o, gate + up (one Int8GatedMLP matmul), down per
    # layer, and lm_head (patch_model's default)
    assert len(layers) == 2 * 4 + 1
    assert isinstance(model.lm_head, Int8Linear)
    cur = _prompts(1, 4)
    out = model.generate(cur, max_new_tokens=5, do_sample=False, pad_token_id=PAD)  # still a transformers model
    assert out.shape[1] <= 9


def test_saved_patched_directories_load_as_saved(checkpoints, tmp_path, monkeypatch):
    """A directory save_patched wrote loads through load_patched (no from_pretrained, no second patch):
    load_int8 and gpt_fast give what the models they were saved from give."""
    from gptfast_kernels import save_patched

    saved = {}
    for name in ("target", "draft"):
        saved[name] = str(tmp_path / name)
        save_patched(compat.load_int8(checkpoints[name], device="cpu"), saved[name])
    from_float = compat.gpt_fast(checkpoints["target"], checkpoints["draft"], device="cpu")
    monkeypatch.setattr(compat, "patch_model", lambda *args, **kwargs: pytest.fail("patched a second time"))
    model = compat.load_int8(saved["target"], device="cpu")
    assert isinstance(model.lm_head, Int8Linear)
    fast = compat.gpt_fast(saved["target"], saved["draft"], device="cpu")
    cur = _prompts(2, 5)
    torch.testing.assert_close(fast.generate(cur, 5 + 12, 3), from_float.generate(cur, 5 + 12, 3), rtol=0, atol=0)
    # another dtype: the float tensors converted as they are read (load_patched's dtype=), not patched again
    assert compat.load_int8(saved["target"], device="cpu", dtype=torch.bfloat16).dtype == torch.bfloat16


def test_add_kv_cache_prefill_forward_rollback(checkpoints, monkeypatch):
    monkeypatch.setattr(compat, "_INITIAL_CACHE_SLOTS", 2)  # the cache must grow along the way
    kv = compat.add_kv_cache(checkpoints["target"], device="cpu")
    assert isinstance(kv, compat.KVCacheModel) and compat.add_kv_cache(kv) is kv
    reference = AutoModelForCausalLM.from_pretrained(checkpoints["target"]).eval()
    seq = _prompts(2, 12)

    def expected(n):
        with torch.no_grad():
            return reference(seq[:, :n]).logits[:, -1]

    torch.testing.assert_close(kv.prefill(seq[:, :4]), expected(4), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv.forward(seq[:, :5]), expected(5), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv(seq[:, :9]), expected(9), rtol=1e-4, atol=1e-4)
    kv.rollback_cache(6)
    torch.testing.assert_close(kv(seq[:, :12]), expected(12), rtol=1e-4, atol=1e-4)
    kv.clear()
    assert kv.cache is None


def test_kv_cache_model_remembers_the_prompts_padding(checkpoints):
    """prefill's mask pads on either side: the logits are each row's at its last real token, and a
    rollback into the padding keeps it padding when the columns run again."""
    kv = compat.add_kv_cache(checkpoints["target"], device="cpu")
    reference = AutoModelForCausalLM.from_pretrained(checkpoints["target"]).eval()
    seq = _prompts(2, 10)
    mask = torch.ones(2, 10, dtype=torch.int64)

    def expected(tokens, mask):
        with torch.no_grad():
            logits = reference(tokens, attention_mask=mask).logits
        return torch.stack([logits[b, int(mask[b].nonzero().max())] for b in range(2)])

    right = mask[:, :7].clone()
    right[0, 4:] = 0  # row 0 is right-padded (its logits were a padding column's)
    torch.testing.assert_close(kv.prefill(seq[:, :7], right), expected(seq[:, :7], right), rtol=1e-4, atol=1e-4)
    left = mask.clone()
    left[0, :3] = 0
    kv.prefill(seq[:, :8], left[:, :8])
    kv.rollback_cache(2)  # row 0: both columns are padding
    torch.testing.assert_close(kv(seq), expected(seq, left), rtol=1e-4, atol=1e-4)
    kv.rollback_cache(1)
    with pytest.raises(ValueError, match="row 0 has no real token"):
        kv(seq[:, :3])
    for bad, error in ((left[:, :9], ValueError), (left[:, :8].tolist(), TypeError), (left[:, :8] * 2, ValueError),
                       (torch.zeros(2, 8, dtype=torch.int64), ValueError)):
        with pytest.raises(error, match="attention_mask"):
            kv.prefill(seq[:, :8], bad)
    with pytest.raises(ValueError, match="input_ids"):  # (an IndexError in the embedding before)
        kv.prefill(seq[:, :8] + VOCAB)
    kv.prefill(seq[:, :8])
    with pytest.raises(ValueError, match="input_ids"):
        kv(torch.cat([seq[:, :8], seq[:, 8:] + VOCAB], dim=1))


def test_kv_cache_model_refuses_positions_past_a_learned_table():
    """GPT-2's learned positions hold n_positions: a sequence longer fails inside the embedding; it
    is refused, naming the table (prefill and forward alike)."""
    from python_tests.tiny_models import tiny_model

    kv = compat.KVCacheModel(tiny_model("gpt2", n_positions=16))
    seq = torch.randint(3, 90, (1, 17))
    with pytest.raises(ValueError, match="KVCacheModel.prefill.*position table holds"):
        kv.prefill(seq)
    kv.prefill(seq[:, :10])
    assert kv(seq[:, :16]).shape[0] == 1
    with pytest.raises(ValueError, match="KVCacheModel.forward.*position table holds"):
        kv(seq)


@pytest.mark.parametrize("family", ["gemma4_text", "mamba", "jamba", "falcon_h1"])
def test_kv_cache_model_grows_every_kind_of_cache(family, monkeypatch):
    """Growing past the first allocation: layers reading another's keys (Gemma 4) have none to copy
    (a TypeError before), and recurrent states (Mamba, Jamba, Falcon-H1's beside attention) are rebuilt
    by running the sequence again (an AttributeError before, and for Falcon-H1 fresh states: other
    logits). Before the first growth, two columns at once: Mamba-1 blocks (Mamba, Jamba) ran them
    from a zero state (other logits)."""
    from python_tests.tiny_models import tiny_model

    monkeypatch.setattr(compat, "_INITIAL_CACHE_SLOTS", 2)
    reference = tiny_model(family)
    kv = compat.KVCacheModel(copy.deepcopy(reference))
    seq = torch.randint(3, reference.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    kv.prefill(seq[:, :3])
    for n in (5, 6, 12):  # 3 + 2 slots, then grown to 10, then to 20
        with torch.no_grad():
            want = reference(seq[:, :n]).logits[:, -1]
        torch.testing.assert_close(kv(seq[:, :n]), want, rtol=1e-4, atol=1e-4)
    assert kv.cache.max_cache_len == 20


def test_add_speculative_decode_kv_cache(checkpoints):
    target = compat.add_kv_cache(checkpoints["target"], device="cpu")
    draft = AutoModelForCausalLM.from_pretrained(checkpoints["draft"]).eval()  # a plain model works as well
    model = compat.add_speculative_decode_kv_cache(target, draft, _argmax)
    cur = _prompts(1, 3)
    torch.testing.assert_close(model.generate(cur, 15, 2), _hf_greedy(checkpoints["target"], cur, 12), rtol=0, atol=0)


def test_generate_text_fast(checkpoints):
    text = compat.generate_text_fast(checkpoints["target"], checkpoints["draft"], "w3 w4 w5", 12)
    assert isinstance(text, str) and text.startswith("w3 w4 w5") and len(text.split()) > 3
    texts = compat.generate_text_fast(checkpoints["target"], checkpoints["draft"], ["w7", "w8 w9 w10"], 10, int8=False)
    assert isinstance(texts, list) and texts[0].startswith("w7") and texts[1].startswith("w8 w9 w10")
    # each row as alone: max_length tokens of its own (the short prompt's padding counted before)
    assert texts == [compat.generate_text_fast(checkpoints["target"], checkpoints["draft"], text, 10, int8=False)
                     for text in ("w7", "w8 w9 w10")]
    # a stop string: the text up to the word that completes it
    word = text.split()[5]
    cut = compat.generate_text_fast(checkpoints["target"], checkpoints["draft"], "w3 w4 w5", 12, stop_strings=[word])
    continuation = text.split()[3:]
    assert cut.split() == text.split()[:3] + continuation[:continuation.index(word) + 1] != text.split()


def test_quantize_command_writes_what_generate_text_fast_loads(checkpoints, tmp_path, capsys):
    """`python -m gptfast_kernels quantize` patches a checkpoint, saves it with its tokenizer, and the
    saved directories give generate_text_fast the text the float checkpoints give it (int8 either way)."""
    from gptfast_kernels.cli import main

    out = {name: str(tmp_path / name) for name in ("target", "draft")}
    for name in out:
        assert main(["quantize", checkpoints[name], out[name], "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    assert "no tokenizer saved" in printed  # (the draft checkpoint has none; the target's was copied)
    assert (tmp_path / "target" / "tokenizer.json").exists()
    prompts = ["w3 w4 w5", "w7"]
    assert (compat.generate_text_fast(out["target"], out["draft"], prompts, 14)
            == compat.generate_text_fast(checkpoints["target"], checkpoints["draft"], prompts, 14))
    assert main(["quantize", checkpoints["draft"], str(tmp_path / "skip"), "--int8-skip", "lm_head"]) == 0
    loaded = compat.load_int8(str(tmp_path / "skip"), device="cpu")
    assert not isinstance(loaded.lm_head, Int8Linear) and loaded.dtype == torch.bfloat16
    assert main(["quantize", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert "quantize: cannot load model" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_quantize_refuses_what_would_lose_or_overwrite_a_model(checkpoints, tmp_path, capsys):
    """quantize on a directory save_patched wrote loaded none of its int8 weights (from_pretrained:
    every layer random) and saved that, over the model itself when OUTPUT was MODEL; an output that
    is a file or the checkpoint's own directory, or a family patch_model does not serve, were
    tracebacks. Each is now a message and exit status 2, before anything is written."""
    from transformers import AutoConfig

    from gptfast_kernels.cli import main

    target, saved = checkpoints["target"], str(tmp_path / "saved")
    assert main(["quantize", target, saved, "--dtype", "float32"]) == 0
    weights = open(os.path.join(saved, "model.safetensors"), "rb").read()
    (tmp_path / "a_file").write_text("x")
    bert = str(tmp_path / "bert")
    AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "bert", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=VOCAB,
        is_decoder=True)).save_pretrained(bert)
    capsys.readouterr()
    for model, output, words in ((saved, str(tmp_path / "again"), "is a directory save_patched wrote"),
                                 (saved, saved, "is a directory save_patched wrote"),
                                 (target, target, "is the model's own directory"),
                                 (target, str(tmp_path / "a_file"), "is a file"),
                                 (bert, str(tmp_path / "q_bert"), "does not support model_type 'bert'")):
        assert main(["quantize", model, output]) == 2, (model, output)
        err = capsys.readouterr().err
        assert f"quantize: {output!r}" in err or words in err, err
        assert words in err and "Traceback" not in err, err
    assert not (tmp_path / "again").exists() and not (tmp_path / "q_bert").exists()
    assert open(os.path.join(saved, "model.safetensors"), "rb").read() == weights
    # generate: --no-int8 cannot undo a saved model's int8 weights (it was ignored); a library error
    # names the command once ("generate: generate: ..." before)
    assert main(["generate", saved, "w3", "--device", "cpu", "--no-int8"]) == 2
    assert "--no-int8 cannot undo" in capsys.readouterr().err
    assert main(["generate", bert, "w3", "--device", "cpu"]) == 2
    assert "does not support model_type 'bert'" in capsys.readouterr().err
    assert main(["generate", target, "w3", "--device", "cpu", "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert "generate: temperature must be" in err and "generate: generate:" not in err, err


def _continuation(text: str, prompt: str) -> str:
    assert text.startswith(prompt)
    return text[len(prompt):].strip()


def test_generate_command_prints_what_generate_text_fast_continues(checkpoints, tmp_path, capsys, monkeypatch):
    """`python -m gptfast_kernels generate`: one prompt streamed, several printed in turn; plain,
    draft and prompt-lookup decoding print the same greedy text (int8, as generate_text_fast's), a
    stop string cuts it, a save_patched directory gives the same, standard input is a prompt."""
    from gptfast_kernels.cli import main

    target, draft = checkpoints["target"], checkpoints["draft"]
    prompts = ["w3 w4 w5", "w7 w8"]
    want = [_continuation(text, prompt) for text, prompt in
            zip(compat.generate_text_fast(target, draft, prompts, 14, device="cpu"), prompts)]
    base = ["--max-new-tokens", str(14 - 3), "--device", "cpu"]
    assert main(["generate", target, prompts[0], *base]) == 0
    streamed = capsys.readouterr()
    assert streamed.out.strip() == want[0] and "tokens/s" in streamed.err
    for extra in ([], ["--draft", draft], ["--prompt-lookup", "--speculate-k", "2"], ["--batch-size", "1"]):
        assert main(["generate", target, *prompts, *base, *extra]) == 0
        printed = capsys.readouterr()
        assert printed.out == f"--- 0\n{want[0]}\n--- 1\n{want[1]}\n", extra
        assert ("accepted" in printed.err) == bool(extra[:1] in (["--draft"], ["--prompt-lookup"])), extra
    # prompts from a file, continuous batching over 2 rows for 3 prompts (speculative rounds too)
    (tmp_path / "prompts.txt").write_text(f"{prompts[1]}\n\n{prompts[0]}\n{prompts[1]}\n")
    for extra in ([], ["--draft", draft], ["--prompt-lookup", "--speculate-k", "2"], ["--max-prefill-tokens", "2"],
                  ["--prompt-lookup", "--max-prefill-tokens", "3"], ["--reuse-prefixes"],
                  ["--draft", draft, "--reuse-prefixes"]):
        assert main(["generate", target, "--prompts-file", str(tmp_path / "prompts.txt"), *base, "--batch-size", "2",
                     *extra]) == 0
        printed = capsys.readouterr()
        assert printed.out == f"--- 0\n{want[1]}\n--- 1\n{want[0]}\n--- 2\n{want[1]}\n", extra
        assert "continuous batching over 2 rows" in printed.err
        assert ("accepted" in printed.err) == (extra[:1] in (["--draft"], ["--prompt-lookup"])), extra
    word = want[0].split()[2]
    assert main(["generate", target, prompts[0], *base, "--stop", word]) == 0
    assert capsys.readouterr().out.split() == want[0].split()[:want[0].split().index(word) + 1]
    assert main(["quantize", target, str(tmp_path / "saved"), "--dtype", "float32"]) == 0
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO(prompts[0]))
    assert main(["generate", str(tmp_path / "saved"), "-", *base]) == 0
    assert capsys.readouterr().out.strip() == want[0]


def test_generate_command_refuses_what_it_cannot_do(checkpoints, tmp_path, capsys):
    from gptfast_kernels.cli import main

    target, draft = checkpoints["target"], checkpoints["draft"]
    assert main(["generate", str(tmp_path / "nowhere"), "w3", "--device", "cpu"]) == 2
    assert "generate: cannot load model" in capsys.readouterr().err
    assert main(["generate", draft, "w3", "--device", "cpu"]) == 2  # (the draft checkpoint has no tokenizer)
    assert "no loadable tokenizer" in capsys.readouterr().err
    assert main(["generate", target, "w3", "--device", "cpu", "--temperature", "-1"]) == 2
    assert "temperature must be" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", target, "w3", "--draft", draft, "--prompt-lookup"])
    assert main(["generate", target, "w3", "--device", "cpu", "--prompt-lookup", "--batch-size", "2",
                 "--speculate-k", "0"]) == 2
    assert "speculate_k" in capsys.readouterr().err
    assert main(["generate", target, "--device", "cpu"]) == 2
    assert "no prompt given" in capsys.readouterr().err
    assert main(["generate", target, "--prompts-file", str(tmp_path / "none.txt"), "--device", "cpu"]) == 2
    assert "--prompts-file" in capsys.readouterr().err
    assert main(["generate", target, "w3", "--device", "cpu", "--batch-size", "0"]) == 2
    assert "batch_size" in capsys.readouterr().err
    assert main(["generate", target, "w3", "--device", "cpu", "--batch-size", "2", "--max-prefill-tokens", "0"]) == 2
    assert "max_prefill_tokens" in capsys.readouterr().err
    assert main(["generate", target, "w3", "--device", "cpu", "--max-prefill-tokens", "4"]) == 2
    assert "--batch-size" in capsys.readouterr().err
    assert main(["generate", target, "w3", "--device", "cpu", "--reuse-prefixes"]) == 2
    assert "--batch-size" in capsys.readouterr().err
    # a device that is not one, or that torch does not have (tracebacks from torch before)
    bad_devices = ["banana", "mps", f"cuda:{torch.cuda.device_count()}"]
    for command in (["generate", target, "w3"], ["quantize", target, str(tmp_path / "q")]):
        for device in bad_devices:
            assert main([*command, "--device", device]) == 2
            err = capsys.readouterr().err
            assert f"{command[0]}: --device" in err and device in err and "Traceback" not in err
    assert not (tmp_path / "q").exists()


def test_bad_arguments_name_the_argument(checkpoints):
    target, draft = checkpoints["target"], checkpoints["draft"]
    with pytest.raises(TypeError, match="model_name"):
        compat.gpt_fast(123, draft)
    with pytest.raises(TypeError, match="draft_model_name"):
        compat.gpt_fast(target, 4.5)
    with pytest.raises(TypeError, match="sample_function"):
        compat.gpt_fast(target, draft, sample_function="argmax")
    with pytest.raises(TypeError, match="quantize_config"):
        compat.gpt_fast(target, draft, quantize_config={})
    with pytest.raises(ValueError, match="vocabulary"):
        compat.gpt_fast(target, checkpoints["other_vocab"])
    with pytest.raises(TypeError, match="model_name"):
        compat.load_int8(None)
    with pytest.raises(TypeError, match="draft_model"):
        compat.add_speculative_decode_kv_cache(compat.add_kv_cache(target), "not a model")
    model = compat.gpt_fast(target, draft, int8=False, device="cpu")
    cur = _prompts(1, 5)
    with pytest.raises(TypeError, match="cur_tokens"):
        model.generate([[3, 4, 5]], 10, 2)
    with pytest.raises(ValueError, match="cur_tokens"):
        model.generate(cur[0], 10, 2)
    with pytest.raises(ValueError, match="max_tokens"):
        model.generate(cur, 5, 2)
    with pytest.raises(ValueError, match="speculate_k"):
        model.generate(cur, 10, 0)
    with pytest.raises(TypeError, match="temprature"):
        model.generate(cur, 10, 2, temprature=0.5)
    for returns, error in ((lambda p: p, ValueError), (lambda p: None, TypeError), (lambda p: "3", TypeError),
                           (lambda p: True, ValueError)):
        with pytest.raises(error, match="sample_function"):
            compat.gpt_fast(target, draft, lambda self, p, f=returns: f(p), int8=False,
                            device="cpu").generate(cur, 10, 2)
    assert model.generate(cur, 8, 10**12).shape == (1, 8)  # (drafts past max_tokens: an allocation error before)
    with pytest.raises(TypeError, match="sequence"):
        compat.generate_text_fast(target, draft, 42, 10)
    with pytest.raises(ValueError, match="max_length"):
        compat.generate_text_fast(target, draft, "w3 w4 w5", 2)
    for empty in ("", ["w3", "  "]):  # (named cur_tokens before)
        with pytest.raises(ValueError, match="sequence"):
            compat.generate_text_fast(target, draft, empty, 5)
    with pytest.raises(ValueError, match="model_path"):
        compat.generate_text_fast(draft, draft, "w3", 5)  # the draft directory has no tokenizer
