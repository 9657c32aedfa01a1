"""save_patched / load_patched: a patched model written to a directory and built back on the meta device
decodes exactly as the saved one (every family), keeps its int8 layers, tied weights, options and dtype,
never holds a float copy of an int8 weight, and bad directories or models raise clear errors."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from gptfast_kernels import Int8Linear, generate, load_patched, patch_model, save_patched
from gptfast_kernels.models import serialization
from python_tests.tiny_models import FAMILIES, ragged_prompts, tiny_model


def _tensor_bytes(model):
    """Bytes of every distinct parameter / buffer storage the model holds."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.numel():  # (an empty tensor's data pointer may be anyone's)
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def _decode(model, ids, mask):
    return generate(model, ids, mask, max_new_tokens=4, output_logprobs=True)


def _module_types(model):
    return {name: type(module).__name__ for name, module in model.named_modules()}


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_model_decodes_exactly_as_the_saved_one(family, tmp_path):
    model = patch_model(tiny_model(family))
    ids, mask = ragged_prompts(2, 7, "left")
    want = _decode(model, ids, mask)
    save_patched(model, tmp_path)
    loaded = load_patched(tmp_path, device="cpu")
    got = _decode(loaded, ids, mask)
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(got.logprobs, want.logprobs)
    with torch.no_grad():  # and without a cache (transformers' own attention path; Gemma 2's gives a padding
        # column, which no key is left to attend to, NaN logits: the same in both)
        torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits,
                                   rtol=0, atol=0, equal_nan=True)
    assert _module_types(loaded) == _module_types(model)
    assert not loaded.training
    assert _tensor_bytes(loaded) == _tensor_bytes(model)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "deepseek_v3", "falcon", "bloom"])
def test_loading_builds_no_float_weights(family, tmp_path, monkeypatch):
    """The float model is built on the meta device: no Linear weight is ever allocated with data, and the
    loaded model's tensors are exactly the file's (int8 qweight, float32 scales, float norms / embeddings)."""
    save_patched(patch_model(tiny_model(family)), tmp_path)
    made = []
    linear_init = torch.nn.Linear.__init__

    def recording_init(self, *args, **kwargs):
        linear_init(self, *args, **kwargs)
        made.append(self.weight.device.type)

    monkeypatch.setattr(torch.nn.Linear, "__init__", recording_init)
    loaded = load_patched(tmp_path, device="cpu")
    assert made and set(made) == {"meta"}
    saved = load_file(os.path.join(tmp_path, serialization.WEIGHTS_FILE))
    assert _tensor_bytes(loaded) == sum(t.untyped_storage().nbytes() for t in saved.values())
    assert any(t.dtype == torch.int8 for t in saved.values())
    assert all(t.device.type == "cpu" for t in [*loaded.parameters(), *loaded.buffers()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8, int8_skip", [(True, ()), (True, ("lm_head", "o_proj")), (False, ())],
                         ids=["int8", "int8-skip", "float"])
def test_options_dtype_and_layer_kinds_survive(dtype, int8, int8_skip, tmp_path):
    model = patch_model(tiny_model("llama").to(dtype), int8=int8, int8_skip=int8_skip)
    save_patched(model, tmp_path)
    loaded = load_patched(tmp_path, device="cpu")
    assert loaded.dtype == dtype
    assert loaded._gptfast_patch_options == model._gptfast_patch_options
    assert isinstance(loaded.lm_head, Int8Linear) == (int8 and "lm_head" not in int8_skip)
    assert isinstance(loaded.model.layers[0].self_attn.o_proj, Int8Linear) == (int8 and "o_proj" not in int8_skip)
    ids, mask = ragged_prompts(3, 6, "right")
    assert torch.equal(_decode(loaded, ids, mask).logprobs, _decode(model, ids, mask).logprobs)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3_text", "falcon", "deepseek_v3"])
@pytest.mark.parametrize("saved_dtype, dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, torch.float16)])
def test_loads_in_another_dtype(family, saved_dtype, dtype, tmp_path):
    """dtype=: every tensor is the saved one in the dtype its place has in a model built and patched
    in that dtype (float weights converted, int8 weights as they are, float32 buffers kept), and
    the model decodes in it."""
    from transformers import AutoModelForCausalLM

    model = patch_model(tiny_model(family).to(saved_dtype))
    save_patched(model, tmp_path)
    loaded = load_patched(tmp_path, device="cpu", dtype=dtype)
    assert loaded.dtype == dtype
    with torch.device("meta"):
        fresh = patch_model(AutoModelForCausalLM.from_config(model.config, dtype=dtype),
                            **model._gptfast_patch_options)
    places, saved = serialization._named_tensors(fresh), serialization._named_tensors(model)
    got = serialization._named_tensors(loaded)
    assert set(got) == set(saved)
    for name, tensor in got.items():
        assert tensor.dtype == places[name].dtype, name
        assert torch.equal(tensor, saved[name].to(tensor.dtype)), name
    assert any(t.dtype == torch.int8 for t in got.values()) and any(t.dtype == dtype for t in got.values())
    ids, mask = ragged_prompts(2, 5, "left")
    out = _decode(loaded, ids, mask)
    assert out.sequences.shape == (2, 9) and torch.isfinite(out.logprobs).all()
    with pytest.raises(ValueError, match="dtype"):
        load_patched(tmp_path, device="cpu", dtype=torch.int8)


def test_tied_weights_stay_one_tensor(tmp_path):
    # float head tied to the input embeddings: one tensor, saved once, loaded as one Parameter
    model = patch_model(tiny_model("llama", tie_word_embeddings=True), int8_skip=("lm_head",))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_patched(model, tmp_path)
    assert set(json.load(open(tmp_path / serialization.PATCH_FILE))["aliases"]) == {"lm_head.weight"}
    loaded = load_patched(tmp_path, device="cpu")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    # Zamba2's shared blocks: one Int8Linear used by several layers stays one module with one qweight
    model = patch_model(tiny_model("zamba2"))
    save_patched(model, tmp_path / "zamba2")
    loaded = load_patched(tmp_path / "zamba2", device="cpu")
    def int8_weights(m):
        return {id(layer.qweight) for layer in m.modules() if isinstance(layer, Int8Linear)}

    int8_uses = [name for name, layer in model.named_modules(remove_duplicate=False) if isinstance(layer, Int8Linear)]
    assert len(int8_uses) > len(int8_weights(model))  # (the test needs shared layers)
    assert len(int8_weights(loaded)) == len(int8_weights(model))
    assert _tensor_bytes(loaded) == _tensor_bytes(model)


def test_generation_config_is_kept(tmp_path):
    model = patch_model(tiny_model("qwen2"))
    model.generation_config.eos_token_id = [1, 5]
    save_patched(model, tmp_path)
    assert load_patched(tmp_path, device="cpu").generation_config.eos_token_id == [1, 5]


def test_bad_models_and_directories_raise(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="model is not patched"):
        save_patched(model, tmp_path / "unpatched")
    with pytest.raises(TypeError, match="model must be a transformers model"):
        save_patched(torch.nn.Linear(2, 2), tmp_path / "linear")
    patch_model(model)
    with pytest.raises(TypeError, match="directory must be a path"):
        save_patched(model, None)
    with pytest.raises(TypeError, match="directory must be a path"):
        load_patched(3)
    with pytest.raises(ValueError, match="does not exist"):
        load_patched(tmp_path / "missing")
    model.save_pretrained(tmp_path / "float")  # transformers' own checkpoint: not ours
    with pytest.raises(ValueError, match="no gptfast_kernels.json"):
        load_patched(tmp_path / "float")
    with pytest.raises(ValueError, match="holds 'model.safetensors' that save_patched did not write"):
        save_patched(model, tmp_path / "float")  # (which would have replaced its weights)
    assert (tmp_path / "float" / "model.safetensors").exists()
    assert not (tmp_path / "float" / serialization.PATCH_FILE).exists()
    saved = tmp_path / "saved"
    save_patched(model, saved)
    with pytest.raises(ValueError, match="device must hold data"):
        load_patched(saved, device="meta")
    patch_file = saved / serialization.PATCH_FILE
    original = json.load(open(patch_file))
    json.dump({**original, "format_version": 99}, open(patch_file, "w"))
    with pytest.raises(ValueError, match="format version 99"):
        load_patched(saved)
    json.dump({**original, "dtype": "torch.int4"}, open(patch_file, "w"))
    with pytest.raises(ValueError, match="dtype 'torch.int4'"):
        load_patched(saved)
    json.dump({key: value for key, value in original.items() if key != "weights"}, open(patch_file, "w"))
    with pytest.raises(ValueError, match=r"lacks \['weights'\]"):
        load_patched(saved)
    json.dump({**original, "model_class": "GPT2LMHeadModel"}, open(patch_file, "w"))
    with pytest.raises(ValueError, match="holds a GPT2LMHeadModel"):
        load_patched(saved)
    json.dump({**original, "patch": {**original["patch"], "int8": False}}, open(patch_file, "w"))
    with pytest.raises(ValueError, match="does not match the model its config builds here"):
        load_patched(saved, device="cpu")
    json.dump(original, open(patch_file, "w"))
    weights_file = saved / serialization.WEIGHTS_FILE
    tensors = load_file(weights_file)
    tensors["lm_head.scales"] = tensors["lm_head.scales"][:-1].clone()
    save_file(tensors, weights_file)
    with pytest.raises(ValueError, match=r"lm_head.scales is \(96,\) torch.float32 .* but \(97,\)"):
        load_patched(saved, device="cpu")
    del tensors["lm_head.scales"]
    save_file(tensors, weights_file)
    with pytest.raises(ValueError, match="model.safetensors' does not hold the tensors gptfast_kernels.json lists"):
        load_patched(saved, device="cpu")
    del original["weights"]["lm_head.scales"]
    json.dump(original, open(patch_file, "w"))
    with pytest.raises(ValueError, match="missing \\['lm_head.scales'\\]"):
        load_patched(saved, device="cpu")
    with pytest.raises(ValueError, match="max_shard_bytes must be a positive int"):
        save_patched(model, saved, max_shard_bytes=0)


def test_damaged_directories_raise_naming_what_is_wrong(tmp_path):
    """A hand-edited or damaged directory: each gets load_patched's ValueError naming the file or
    key (they were JSON, attribute, type, safetensors and file-not-found errors from inside), and a
    weights map pointing outside the directory is refused rather than followed."""
    import shutil

    good = tmp_path / "good"
    save_patched(patch_model(tiny_model("llama")), good)
    original = json.load(open(good / serialization.PATCH_FILE))

    def damaged(name, edit):
        directory = tmp_path / name
        shutil.copytree(good, directory)
        edit(directory)
        return directory

    def rewrite(**changes):
        return lambda d: json.dump({**original, **changes}, open(d / serialization.PATCH_FILE, "w"))

    cases = [
        (lambda d: (d / serialization.PATCH_FILE).write_text("{oops"), "cannot read .*gptfast_kernels.json"),
        (lambda d: (d / serialization.PATCH_FILE).write_text("[1, 2]"), "holds a list"),
        (rewrite(patch=None), "patch must hold"),
        (rewrite(patch={**original["patch"], "bogus": 1}), "patch must hold"),
        (rewrite(weights=dict.fromkeys(original["weights"], "../good/model.safetensors")),
         "names weights file '../good/model.safetensors'"),
        (rewrite(aliases=[1]), "weights and aliases must map"),
        (rewrite(rope_state={"model.rotary_emb": {"inv_freq": 1}}), "rope_state"),
        (rewrite(rope_state={"model.rotary_emb": {"max_seq_len_cached": "40"}}), "rope_state"),
        (rewrite(rope_state={"model.nowhere": {"max_seq_len_cached": 40}}), "RoPE state for 'model.nowhere'"),
        (lambda d: open(d / serialization.WEIGHTS_FILE, "r+b").truncate(1000), "cannot read .*model.safetensors"),
        (lambda d: os.remove(d / serialization.WEIGHTS_FILE), "lacks 'model.safetensors'"),
        (lambda d: os.remove(d / "config.json"), "lacks config.json"),
    ]
    for i, (edit, words) in enumerate(cases):
        with pytest.raises(ValueError, match=words):
            load_patched(damaged(f"case{i}", edit), device="cpu")
    with pytest.raises(ValueError, match="is a file"):
        load_patched(good / serialization.WEIGHTS_FILE, device="cpu")
    for device, words in (("gpu", "device 'gpu' is not a device"), (object(), "is not a device")):
        with pytest.raises(ValueError, match=words):
            load_patched(good, device=device)
    if not torch.cuda.is_available():
        for device in ("cuda", 0):
            with pytest.raises(ValueError, match="torch sees 0 CUDA device"):
                load_patched(good, device=device)


def test_another_checkpoints_directory_is_never_written_over(tmp_path):
    """save_patched into a directory holding another checkpoint (a PyTorch-format one, an index,
    a config alone) is refused before it writes: its config.json was replaced silently."""
    model = patch_model(tiny_model("llama"))
    for name in ("pytorch_model.bin", "model.safetensors.index.json", "config.json", "tf_model.h5"):
        directory = tmp_path / name.replace(".", "_")
        directory.mkdir()
        (directory / name).write_text("theirs")
        with pytest.raises(ValueError, match=f"holds '{name}' that save_patched did not write"):
            save_patched(model, directory)
        assert sorted(os.listdir(directory)) == [name] and (directory / name).read_text() == "theirs"
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        save_patched(model, tmp_path / "a_file")


def test_a_compiled_model_saves_as_the_model_it_compiled(tmp_path):
    # (torch.compile's wrapper was written with '_orig_mod.' names, which load_patched refused)
    model = patch_model(tiny_model("llama"))
    save_patched(torch.compile(model), tmp_path)
    ids, mask = ragged_prompts(2, 5, "left")
    assert torch.equal(_decode(load_patched(tmp_path, device="cpu"), ids, mask).logprobs,
                       _decode(model, ids, mask).logprobs)


def test_dynamic_rope_state_and_grown_tables_survive(tmp_path):
    """State a model grows as it runs: dynamic-NTK RoPE past its table keeps scaled frequencies and
    the length it grew to (a plain attribute, which was lost: the loaded model kept the scaled
    frequencies on short inputs, where the saved one resets them, and decoded other tokens); XGLM's
    sinusoidal table grown past its size (a non-persistent buffer, which load_patched refused)."""
    model = patch_model(tiny_model("llama", max_position_embeddings=16,
                                   rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}))
    long_ids, short = torch.randint(3, 90, (1, 40)), torch.randint(3, 90, (1, 8))
    with torch.no_grad():
        model(long_ids)  # (grows the frequencies' scale to 40 positions)
    save_patched(model, tmp_path / "dynamic")
    loaded = load_patched(tmp_path / "dynamic", device="cpu")
    with torch.no_grad():
        want, got = model(short).logits, loaded(short).logits
    assert torch.equal(want, got)
    xglm = patch_model(tiny_model("xglm"))
    rows = xglm.model.embed_positions.weights.shape[0]
    generate(xglm, torch.randint(3, 90, (1, rows - 8)), max_new_tokens=12)  # (a cache past the table)
    assert xglm.model.embed_positions.weights.shape[0] > rows
    save_patched(xglm, tmp_path / "xglm")
    loaded = load_patched(tmp_path / "xglm", device="cpu")
    assert torch.equal(loaded.model.embed_positions.weights, xglm.model.embed_positions.weights)
    ids, mask = ragged_prompts(2, 5, "left")
    assert torch.equal(_decode(loaded, ids, mask).logprobs, _decode(xglm, ids, mask).logprobs)


def test_a_tensor_made_at_patch_time_outside_the_buffers_is_named(tmp_path, monkeypatch):
    """A module attribute computed from the weights while patching is meta after a meta build and is not
    in the file: loading names it rather than handing back a model that fails at its first forward."""
    save_patched(patch_model(tiny_model("llama")), tmp_path)

    def patch_keeping_a_table(model, **options):
        patch_model(model, **options)
        model.lm_head.table = model.lm_head.scales * 2  # (a plain attribute: not saved)
        return model

    monkeypatch.setattr(serialization, "patch_model", patch_keeping_a_table)
    with pytest.raises(ValueError, match="lm_head.table has no saved value"):
        load_patched(tmp_path, device="cpu")


def test_sharded_save_loads_the_same_model(tmp_path):
    model = patch_model(tiny_model("qwen3_moe"))
    largest = max(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    save_patched(model, tmp_path, max_shard_bytes=largest // 2)  # (a tensor over the bound: a file of its own)
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    ids, mask = ragged_prompts(2, 7, "left")
    assert torch.equal(_decode(load_patched(tmp_path, device="cpu"), ids, mask).logprobs,
                       _decode(model, ids, mask).logprobs)
    save_patched(model, tmp_path)  # saved again in one file: the shards of before go
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors")) == [serialization.WEIGHTS_FILE]
    assert torch.equal(_decode(load_patched(tmp_path, device="cpu"), ids, mask).logprobs,
                       _decode(model, ids, mask).logprobs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
def test_loads_straight_onto_the_gpu(tmp_path):
    model = patch_model(tiny_model("llama").to(torch.bfloat16))
    save_patched(model, tmp_path)
    loaded = load_patched(tmp_path, device="cuda")
    assert all(t.is_cuda for t in [*loaded.parameters(), *loaded.buffers()])
    ids, mask = ragged_prompts(2, 7, "left")
    got = _decode(loaded, ids.cuda(), mask.cuda())
    want = _decode(model.cuda(), ids.cuda(), mask.cuda())
    assert torch.equal(got.sequences, want.sequences)
    assert torch.equal(got.logprobs, want.logprobs)
