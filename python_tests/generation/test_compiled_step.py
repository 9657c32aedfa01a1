"""generation/forward.py's CompiledStep: a compiled step without dynamo's guards on the model's
modules (thousands, evaluated on every call), which checks train / eval mode, the parameters'
dtype and device and its module arguments itself, and which patch_model and forget_compiled drop."""

import contextlib
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from gptfast_kernels import generate, patch_model
from gptfast_kernels.generation import forget_compiled
from gptfast_kernels.generation.forward import CompiledStep, cache_for, step_function
from python_tests.tiny_models import patched_copy, ragged_prompts, tiny_model

NEW = 5


def _generate(model, ids, mask, compile):
    return generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[], compile=compile).sequences


def _step_logits(model, step, tokens):
    """One step of ``step`` on a fresh cache of the model's, after a one-token prompt (its logits
    copied: a compiled call's outputs last until the next compiled call, conftest.py)."""
    cache = cache_for(model, tokens.shape[0], 16, tokens.device, next(model.parameters()).dtype, reuse=True)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    step(tokens, mask, cache)
    return step(tokens, mask, cache).clone()


def test_module_attributes_are_not_guarded_and_forget_compiled_retraces():
    """A module attribute the traced forward reads as a constant (the attention's scaling) changed
    after a compiled call is not seen (no guard re-checks it on every call): that is the saving, and
    why a change to the model's modules needs forget_compiled, after which the step traces the model
    as it is."""
    patched = patched_copy(tiny_model("llama"), int8=True)
    step = step_function(patched, True)
    tokens = torch.tensor([[3], [5]])
    with torch.no_grad():
        before = _step_logits(patched, step, tokens)
        for layer in patched.model.layers:
            layer.self_attn.scaling = 0.0  # uniform attention: other logits at the second step
        eager = _step_logits(patched, step_function(patched, False), tokens)
        assert not torch.allclose(eager, before)
        assert torch.equal(_step_logits(patched, step, tokens), before)  # the old trace
        forget_compiled(patched)
        assert not hasattr(patched, "_gptfast_compiled_forward")
        again = step_function(patched, True)
        assert again is not step
        torch.testing.assert_close(_step_logits(patched, again, tokens), eager)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_compile_call_is_one_torch_accepts_on_every_device(monkeypatch, device):
    """On CUDA the step is compiled with CUDA graphs, beside the guard filter: torch.compile refuses
    a mode together with options (mode="reduce-overhead" did that, so every compiled step on a GPU
    raised before tracing; no CPU run passes a mode). The real torch.compile checks the arguments
    here; the parameters' device is faked, since nothing else of the call depends on it."""
    from gptfast_kernels.generation import forward

    real_compile, calls = torch.compile, []

    def compile_checked(function, **kwargs):
        calls.append({**kwargs, "options": dict(kwargs["options"])})  # (torch.compile takes some options out)
        real_compile(function, **kwargs)  # (raises at once for arguments it refuses; traces nothing)
        return lambda *args: "stepped"

    monkeypatch.setattr(torch, "compile", compile_checked)
    # (inductor's global config left alone: torch 2.11 hides the option it sets, and a patched hidden option
    # breaks every later compile in the process)
    monkeypatch.setattr(forward, "_partition_host_syncing_ops", lambda: None)
    model = tiny_model("llama")
    step = CompiledStep(model, lambda tokens, model=None: tokens)
    step.first_parameter = types.SimpleNamespace(device=torch.device(device), dtype=torch.float32)
    assert step(torch.zeros(1)) == "stepped"
    [kwargs] = calls
    assert "mode" not in kwargs and kwargs["fullgraph"] and kwargs["dynamic"] is False
    assert kwargs["options"].get("triton.cudagraphs", False) == (device == "cuda")
    guards = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    assert kwargs["options"].get("guard_filter_fn") is guards
    with_guards = CompiledStep(model, lambda tokens, model=None: tokens, module_guards=True)
    assert "guard_filter_fn" not in with_guards.compile_options(device == "cuda")


def test_hybrids_compile_unvectorised_on_a_cpu_only_under_an_older_torch():
    """Torch 2.11's C++ code generator miscompiles a hybrid model's speculative and batched steps
    (code that does not build, or heap corruption): there such models' steps compile unvectorised
    on a CPU; never on CUDA, never for models without recurrent layers, never from 2.14."""
    from packaging.version import Version

    from gptfast_kernels.generation import forward

    old = Version(torch.__version__.split("+")[0]) < Version(forward.CPU_VECTORISES_RECURRENT_STATES)
    assert (torch.__version__ < forward.CPU_VECTORISES_RECURRENT_STATES) == old  # (torch's comparison, as used)
    for recurrent in (False, True):
        step = CompiledStep(tiny_model("llama"), lambda tokens, model=None: tokens, recurrent=recurrent)
        assert step.compile_options(on_cuda=False).get("cpp.simdlen") == (1 if recurrent and old else None)
        assert "cpp.simdlen" not in step.compile_options(on_cuda=True)
    hybrid, plain = patched_copy(tiny_model("qwen3_5_text"), int8=True), patched_copy(tiny_model("llama"))
    assert step_function(hybrid, True).recurrent and not step_function(plain, True).recurrent


def test_train_mode_and_dtype_changes_compile_the_step_anew():
    """What changes in normal use is checked on every call: model.train() / eval() and a move to
    another dtype each trace the step anew (the same CompiledStep, kept on the model), and its tokens
    are the eager forward's in the model's new state."""
    patched = patched_copy(tiny_model("llama"), int8=True)
    ids, mask = ragged_prompts(2, 6, "left")
    assert torch.equal(_generate(patched, ids, mask, True), _generate(patched, ids, mask, False))
    step = patched._gptfast_compiled_decode
    assert isinstance(step, CompiledStep)
    first = step.compiled
    patched.train()
    assert torch.equal(_generate(patched, ids, mask, True), _generate(patched, ids, mask, False))
    assert patched._gptfast_compiled_decode is step and step.compiled is not first
    traced_in_train_mode = step.compiled
    patched.eval().to(torch.bfloat16)
    assert torch.equal(_generate(patched, ids, mask, True), _generate(patched, ids, mask, False))
    assert step.compiled is not traced_in_train_mode and step.signature[1] == torch.bfloat16
    again = step.compiled
    _generate(patched, ids, mask, True)
    assert step.compiled is again  # nothing changed: the same trace


def test_a_step_past_the_recompile_limit_starts_afresh_with_a_warning(monkeypatch):
    """Past the recompile limit (here 2) a call of a new kind (a third batch size) would fail under
    fullgraph; the step is compiled afresh instead, with a warning, and gives the eager tokens, as
    do the calls after it (a dropped batch size compiled again)."""
    import gptfast_kernels.generation.forward as forward

    patched = patched_copy(tiny_model("llama", layers=1), int8=True)
    monkeypatch.setattr(forward, "RECOMPILE_LIMIT", 2)
    with torch._dynamo.config.patch(recompile_limit=2):
        for batch, warns in [(1, False), (2, False), (3, True), (1, False)]:
            ids, mask = ragged_prompts(batch, 6, "left")
            with pytest.warns() if warns else contextlib.nullcontext() as caught:
                compiled = _generate(patched, ids, mask, True)
            assert torch.equal(compiled, _generate(patched, ids, mask, False))
            if warns:
                assert [str(w.message) for w in caught] == [
                    "gptfast_kernels: _decode_step of this LlamaForCausalLM was compiled for 2 kinds of call (batch "
                    "sizes, token counts, options); those are dropped and each compiled again when next called"]


def test_patch_model_again_drops_the_compiled_steps():
    """Patching a patched model again (here to plain PyTorch attention) replaces what its compiled
    steps were traced through, so they are dropped and the next compiled call traces the new model."""
    patched = patched_copy(tiny_model("llama"), int8=True)
    ids, mask = ragged_prompts(2, 6, "left")
    _generate(patched, ids, mask, True)
    assert hasattr(patched, "_gptfast_compiled_decode")
    patch_model(patched, fused_attention=False)  # (int8 layers stay int8: patch_model cannot undo them)
    assert not hasattr(patched, "_gptfast_compiled_decode")
    with torch.no_grad():
        tokens = torch.tensor([[3], [5]])
        torch.testing.assert_close(_step_logits(patched, step_function(patched, True), tokens),
                                   _step_logits(patched, step_function(patched, False), tokens))


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_compiled_generation_equals_eager_across_calls(family):
    """Several compiled calls on one model (batch sizes, prompt lengths and the cache it keeps):
    each equals the eager generation."""
    patched = patched_copy(tiny_model(family), int8=True)
    for rows, length in ((2, 6), (1, 4), (3, 7), (2, 6)):
        ids, mask = ragged_prompts(rows, length, "left")
        assert torch.equal(_generate(patched, ids, mask, True), _generate(patched, ids, mask, False))


_USER_COMPILE = """
import torch
from torch._dynamo.testing import CompileCounter
from python_tests.tiny_models import patched_copy, tiny_model
model = patched_copy(tiny_model("llama"), int8=True)
counter = CompileCounter()
forward = torch.compile(lambda ids: model(ids).logits, backend=counter, fullgraph=True)
ids = torch.tensor([[1, 2, 3]])
with torch.no_grad():
    first = forward(ids)
    for _ in range(2):
        assert torch.equal(forward(ids), first)
print("frames", counter.frame_count)
"""


def test_a_users_compiled_forward_before_any_eager_op_call_compiles_once():
    """A user's own torch.compile of a patched model, called before any eager op call in a fresh
    process (so nothing has asked which backends are usable yet), compiles once for repeated calls:
    the answer is computed at import, not inserted into a cache while dynamo traces (which guarded
    on the key's absence, and so compiled a second time on the second call)."""
    run = subprocess.run([sys.executable, "-c", _USER_COMPILE], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "frames 1" in run.stdout.splitlines(), run.stdout
