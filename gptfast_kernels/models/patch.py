"""``patch_model``: int8 weights and fused static-KV-cache attention for a Hugging Face model."""

from __future__ import annotations

import types
import warnings

from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from gptfast_kernels.models import attention
from gptfast_kernels.models import bloom, falcon, gpt_neo, mpt, recurrent, xglm
from gptfast_kernels.models.families import family_of
from gptfast_kernels.models.latent_attention import patch_latent_attention_
from gptfast_kernels.models.dory import patch_dory_
from gptfast_kernels.models.llama4 import patch_llama4_
from gptfast_kernels.models.mamba import patch_mamba_
from gptfast_kernels.models.zamba import patch_zamba_
from gptfast_kernels.modules.fused_qkv import fuse_projections_, fuse_qkv_
from gptfast_kernels.modules.gated_mlp import fuse_gated_mlps_
from gptfast_kernels.modules.int8_experts import quantize_experts_
from gptfast_kernels.modules.int8_linear import quantize_int8_
from gptfast_kernels.modules.static_kv_cache import StaticKVCache, sliding_windows

# Family.own_forwards: what patches such a family's modules, given the model, whether int8 and int8_skip
OWN_FORWARDS = {"dory": patch_dory_, "llama4": patch_llama4_, "mamba": patch_mamba_, "zamba": patch_zamba_}
# Family.own_attention: the module whose fused_attention such a family's attention modules run on a
# StaticKVCache (in place of transformers' forward, which bypasses the AttentionInterface; see
# _own_attention_forward), and whose prepare_attention(module, config), where it has one, readies each
# module at patch time (the ALiBi families' slopes)
OWN_ATTENTION = {"bloom": bloom, "falcon": falcon, "gpt_neo": gpt_neo, "mpt": mpt, "xglm": xglm}


def patch_model(model: nn.Module, *, int8: bool = True, fused_attention: bool = True,
                int8_skip: tuple[str, ...] = ()) -> nn.Module:
    """Swaps in Int8Linear (when ``int8``: every Linear / Conv1D, lm_head included as in gpt-fast
    and torchao, except names matching ``int8_skip``) and makes the model's attention run
    ``kv_cache_attention`` whenever it is called with a StaticKVCache (``fused_attention=False``:
    the same semantics in plain PyTorch). With int8, a gated MLP's gate and up projections become
    one Int8Linear (Int8GatedMLP), and separate q / k / v projections one too (Int8FusedProjections):
    one launch each per step instead of two and three. A mixture-of-experts model's experts become
    Int8Experts (its routers stay float). In place; returns model. Decoding reads every weight
    once per token, and the lm_head is a large share of a small model's weights (a quarter of a
    125M Llama with a 32k vocabulary), so it is quantized too unless skipped.
    Supported families: see gptfast_kernels.models.families.FAMILIES."""
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"patch_model: model must be a transformers model, got {type(model).__name__}")
    if int8_skip is None or not (isinstance(int8_skip, str) or all(isinstance(p, str) for p in int8_skip)):
        raise TypeError(f"patch_model: int8_skip must be a layer name / pattern or a sequence of them (str), "
                        f"got {int8_skip!r}")
    skip = (int8_skip,) if isinstance(int8_skip, str) else tuple(int8_skip)
    before = getattr(model, "_gptfast_patch_options", None)
    if before is not None and before["int8"] and (not int8 or not set(skip) <= set(before["int8_skip"])):
        # (its int8 layers cannot become float again, and save_patched records what this call says)
        raise ValueError(f"patch_model: this model is already patched with int8=True, int8_skip={before['int8_skip']}, "
                         f"and its int8 layers cannot be made float again: patch it again with int8=True and "
                         f"int8_skip among those (fused_attention may change), or patch a fresh copy of the float "
                         f"model; got int8={int8!r}, int8_skip={list(skip)}")
    family = family_of(model.config)
    from gptfast_kernels.generation.forward import forget_compiled  # (generation imports this module)
    forget_compiled(model)  # steps compiled before were traced through the modules this call replaces
    attention_modules = _attention_modules(model, family)  # (patching below swaps their parts, not them)
    # a hybrid's recurrent blocks, per layer index (patching swaps their parts, not them)
    mixers = recurrent.recurrent_mixers(model, family) if recurrent.stateful_layers(family, model.config) else {}
    kinds = family.layer_kinds(model.config.get_text_config(decoder=True))
    attends = any(kind in ("attention", "both") for kind in kinds)
    if not attention_modules and family.attention_class is not None and attends:
        # (a hybrid config whose layers are all recurrent has none, rightly: it is served as Mamba's are)
        raise ValueError(f"patch_model: a {family.model_type} model should contain {family.attention_class} "
                         "modules and this one has none; its transformers version may be unsupported")
    if int8:
        quantize_int8_(model, skip=(*skip, *family.float_linears), linear_subclasses=family.linear_subclasses)
        if family.gated_mlp_class is not None:
            fuse_gated_mlps_(model, family.gated_mlp_class, family.gated_mlp_in_float32)
        fuse_qkv_(model, family.attention_class, attention_modules)
        if family.recurrent_input_projections:  # (ZAYA1's: inside its attention, not one of attention_modules)
            for mixer in mixers.values():
                fuse_projections_(mixer, family.recurrent_input_projections, "input_proj")
    if family.own_forwards:  # (with int8, after the int8 pass above: it may take the int8 modules in)
        OWN_FORWARDS[family.own_forwards](model, int8, skip)
    if int8:
        has_experts = any(type(m).__name__ in family.experts_classes for m in model.modules())
        if has_experts and quantize_experts_(model, family.experts_classes) == 0:
            names = " / ".join(family.experts_classes)
            warnings.warn(f"patch_model: this {family.model_type} model's experts keep their float weights: "
                          f"no {names} module Int8Experts reproduces (3-D gate_up_proj / down_proj, a gating it can "
                          "run, no norm after the experts); attention, dense layers and lm_head are int8",
                          stacklevel=2)
    if family.window_in_mask:
        windows = sliding_windows(model.config)
        for module in attention_modules:
            module._gptfast_sliding_window = windows[module.layer_idx]
    if family.latent_attention:
        patch_latent_attention_(model, family.attention_class, family.latent_attention)
    # what a StaticKVCache for this model must hold (checked per forward by attention.before_forward)
    model._gptfast_cache_geometry = StaticKVCache.geometry_of(model.config)
    # how it was patched, for save_patched / load_patched (models/serialization.py)
    model._gptfast_patch_options = {"int8": bool(int8), "fused_attention": bool(fused_attention),
                                    "int8_skip": list(skip)}
    model._gptfast_cache_keyword = attention.cache_keyword(model)
    model._gptfast_fused_length_zero = family.fused_length_zero
    # what readies the model for a cache before an eager forward (XGLM's position table), or None
    model._gptfast_ready_for_cache = getattr(OWN_ATTENTION.get(family.own_attention), "ready_for_cache", None)
    # a hybrid's recurrent blocks step token by token under a checkpoint (speculative rounds roll them back);
    # why they cannot, or None
    model._gptfast_rollback_blocker = recurrent.install_stepped_mixers(model, family, mixers)
    attention.register_attention_functions()
    attention_function = attention.FUSED if fused_attention else attention.UNFUSED
    if family.own_attention:  # (its attention bypasses the interface: set_attn_implementation would not reach it)
        _install_attention_forward(attention_modules, OWN_ATTENTION[family.own_attention], attention_function,
                                   model.config)
    else:
        model.set_attn_implementation(attention_function)
    if getattr(model, "_gptfast_hooks", None) is None:
        hooks = [model.register_forward_pre_hook(attention.before_forward, with_kwargs=True),
                 model.register_forward_hook(attention.after_forward, with_kwargs=True, always_call=True)]
        if family.layers_drop_keywords:
            hooks += [m.register_forward_pre_hook(attention.before_attention, with_kwargs=True)
                      for m in attention_modules]
        model._gptfast_hooks = tuple(hooks)
    return model


def _attention_modules(model: nn.Module, family) -> list[nn.Module]:
    """The family's attention modules: of class ``family.attention_class`` or, for a family with an
    attention forward of ours (which replaces theirs), of a subclass too (Falcon's and GPT-Neo's
    flash-attention variants, which a model loaded with attn_implementation="flash_attention_2" has)."""
    def matches(module):
        classes = type(module).__mro__ if family.own_attention else (type(module),)
        return any(cls.__name__ == family.attention_class for cls in classes)
    return [module for module in model.modules() if matches(module)]


def _own_attention_forward(self, hidden_states, *args, **kwargs):
    """The forward of an own-attention family's attention module (Family.own_attention): with a
    StaticKVCache (the ``gptfast_cache`` keyword) the family's ``fused_attention(self, hidden_states,
    attend, *args, **kwargs)`` -> [B, T, hidden] (args: what the decoder layer passed after the hidden
    states, BLOOM's residual), where ``attend(q, k, v, **options)`` (q [B, Hq, T, D], k / v
    [B, Hkv, T, D]) runs the registered attention function ``_gptfast_attention`` -> [B, T, Hq * D];
    without one, transformers' forward. -> (output, None)."""
    cache = kwargs.pop("gptfast_cache", None)
    if cache is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    function = ALL_ATTENTION_FUNCTIONS[self._gptfast_attention]

    def attend(query, key, value, **options):
        return function(self, query, key, value, None, gptfast_cache=cache, **options)[0].flatten(-2)

    return self._gptfast_fused_attention(hidden_states, attend, *args, **kwargs), None


def _install_attention_forward(modules: list[nn.Module], code, attention_function: str, config) -> None:
    """In place: every module of ``modules`` gets _own_attention_forward, running ``code.fused_attention``
    through the attention function named ``attention_function``, readied by ``code.prepare_attention``
    (where the family has one) for the model's ``config``."""
    prepare = getattr(code, "prepare_attention", None)
    for module in modules:
        if not hasattr(module, "layer_idx"):  # (GPT-Neo's attention calls it layer_id)
            module.layer_idx = module.layer_id
        module._gptfast_attention = attention_function
        module._gptfast_fused_attention = types.MethodType(code.fused_attention, module)
        module.forward = types.MethodType(_own_attention_forward, module)
        if prepare is not None:
            prepare(module, config)


def is_patched(model: nn.Module) -> bool:
    return getattr(model, "_gptfast_hooks", None) is not None


def forward_with_cache(model: nn.Module, input_ids, cache: StaticKVCache, **kwargs):
    """A patched model's forward on ``cache``, passed by the keyword the model takes it by (``cache``
    from transformers 5.24 on, ``past_key_values`` before), so no deprecation warning is raised."""
    return model(input_ids, **{model._gptfast_cache_keyword: cache}, **kwargs)
