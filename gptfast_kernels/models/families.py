"""The supported model families, as a table: what patching and the cache need to know per family.

Every supported family but Falcon, GPT-Neo, XGLM, BLOOM and MPT routes attention through transformers'
AttentionInterface and its KV cache through ``Cache.update`` (transformers 5.x), so patching needs
no per-family forward: the table records the attention module class (to check a model really has the
structure we rely on), where the config keeps the KV-head count and head size, the gated MLP class
whose gate and up projections are fused into one int8 matmul, and config features we refuse. Sliding
windows and attention soft-capping reach the kernel through the attention keywords each layer passes
(``sliding_window``, ``softcap``), so they need no entry here. Two kinds of family do get forwards
of ours, named by their entries: multi-head latent attention (``latent_attention``:
models/latent_attention.py) and Llama 4 (``own_forwards``: models/llama4.py); Falcon's, GPT-Neo's,
XGLM's, BLOOM's and MPT's attention, which bypass the AttentionInterface, get one too
(``own_attention``: models/falcon.py, models/gpt_neo.py, models/xglm.py, models/bloom.py, models/mpt.py;
the last two and Falcon-RW with ALiBi slopes, models/alibi.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import transformers
from packaging.version import Version


def transformers_before(release: str) -> bool:
    """Whether the installed transformers is older than ``release``."""
    return Version(transformers.__version__) < Version(release)


def layer_types(config) -> list[str | None]:
    """Per decoder layer: the config's ``layer_types`` entry, None without one (no layer_types, or
    fewer than layers). layer_types may also run longer: a config cut to fewer layers."""
    layers = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or ())[:layers]
    return types + [None] * (layers - len(types))


def falcon_kv_heads(config) -> int:
    """The kv heads a Falcon config's attention really has (its ``num_kv_heads`` says the query heads
    count for a multi-query model)."""
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


def kv_sharing_modes(config) -> list[str | None]:
    """Per decoder layer: transformers' KV-sharing mode (Gemma 4): "reuse" for a layer attending over
    the keys and values of the last earlier layer of its type marked "store", else "store" or None.
    Configs before transformers 5.23 have no ``kv_sharing_modes``; their models share the same way:
    the last ``num_kv_shared_layers`` layers reuse the last earlier layer of their type."""
    layers = config.num_hidden_layers
    if hasattr(config, "kv_sharing_modes"):
        modes = list(config.kv_sharing_modes or ())[:layers]
        return modes + [None] * (layers - len(modes))
    first_shared = layers - (getattr(config, "num_kv_shared_layers", 0) or 0)
    if first_shared >= layers:
        return [None] * layers
    types = layer_types(config)
    stores = {max(i for i in range(first_shared) if types[i] == kind)
              for kind in set(types[:first_shared])}
    return ["reuse" if i >= first_shared else "store" if i in stores else None for i in range(layers)]


def kv_sources(config) -> list[int]:
    """Per decoder layer: the index of the layer whose keys and values it attends over, its own but
    for the layers that reuse another's (kv_sharing_modes): the "store" layer of their layer type.
    A looped model's per-loop cache layers (cache_layer_sources) follow, each its own."""
    modes, types = kv_sharing_modes(config), layer_types(config)
    stores = {kind: i for i, (kind, mode) in enumerate(zip(types, modes)) if mode == "store"}
    sources = []
    for i, (kind, mode) in enumerate(zip(types, modes)):
        if mode == "reuse" and kind not in stores:
            raise ValueError(f"layer {i} of this {config.model_type} config reuses the keys and values of a "
                             f"{kind!r} layer, but no layer of that type stores them (kv_sharing_modes)")
        sources.append(stores[kind] if mode == "reuse" else i)
    return sources + list(range(len(sources), len(cache_layer_sources(config))))


def recurrent_loop(config) -> tuple[list[int], int, bool]:
    """A looped model's (Dory's) recurrent section: (its decoder layers, how many times it runs after the
    first, whether each of those runs keeps keys and values of its own: ``recurrent_kv_cache_mode``
    "per_loop", in cache layers after the model's own, one run after another); ([], 0, False) for the
    others."""
    if getattr(config, "model_type", None) != "dory":
        return [], 0, False
    start = config.n_input_layers
    return (list(range(start, start + config.n_recurrent_layers)), config.n_recurrent_loops - 1,
            config.recurrent_kv_cache_mode == "per_loop")


def cache_layer_sources(config) -> list[int]:
    """Per layer of a StaticKVCache for ``config``: the decoder layer it serves. The model's layers, then a
    looped model's per-loop copies of its recurrent section (recurrent_loop)."""
    section, extra_runs, per_loop = recurrent_loop(config)
    return list(range(config.num_hidden_layers)) + (section * extra_runs if per_loop else [])


@dataclass(frozen=True)
class Family:
    model_type: str
    attention_class: str | None     # class name of the self-attention modules (None: attention-free, Mamba)
    kv_heads_attr: str | None       # config attribute with the KV-head count (None: MHA)
    # config attribute with the head size, hidden / heads where the config has none or it is None, as
    # transformers' model code reads it (None: always hidden / heads, as in the families whose code does)
    head_dim_attr: str | None
    gated_mlp_class: str | None = None  # MLP class computing down(act(gate(x)) * up(x)), fused when int8
    gated_mlp_in_float32: bool = False  # whether that MLP computes act(gate) * up in float32 (Beam's)
    # config flags that, when true ("name") or set to a value ("name=value"), break causal decoding
    refused_flags: tuple[str, ...] = ()
    # mixture of experts: the experts module class (names across transformers versions), int8 as Int8Experts
    experts_class: str | tuple[str, ...] | None = None
    # Linear layers that stay float with int8 (patterns as patch_model's int8_skip): routers built as
    # nn.Linear whose model code reads their .weight, and small maps that mix whole hidden states (Gemma 3n)
    float_linears: tuple[str, ...] = ()
    # the first transformers release whose model code torch.compile traces with a StaticKVCache (None: all
    # that gptfast_kernels supports), and what the earlier releases' code does that it cannot trace (given
    # with compiles_from)
    compiles_from: str | None = None
    compiles_from_reason: str | None = None
    # why no transformers release's model code for this family traces (None: it does, see compiles_from)
    compile_blocker: str | None = None
    # hybrid models: the config's layer_types of layers that keep a recurrent (linear-attention /
    # convolution) state instead of keys and values; the cache holds transformers' own state layer there
    recurrent_layer_types: tuple[str, ...] = ()
    # the first transformers release this family works with (None: all that gptfast_kernels supports)
    supported_from: str | None = None
    # whether the model applies its sliding windows through its attention mask alone, its attention
    # passing no sliding_window (PhiMoE, Qwen2-MoE): patch_model hands each attention module its layer's
    # window (_gptfast_sliding_window), which the fused attention, which takes no mask, uses instead
    window_in_mask: bool = False
    # decoder layers that call their attention without transformers' attention keywords (StableLM,
    # Nemotron): a pre-hook on each attention module hands it the cache instead
    layers_drop_keywords: bool = False
    # False where the float experts module is not transformers' experts interface and loops over the
    # routed experts in Python (DBRX): it cannot compile to one graph (its Int8Experts can)
    float_experts_compile: bool = True
    # multi-head latent attention (DeepSeek-V2 / V3 ...): how the family's code rotates its keys
    # (latent_attention.ROPES); its attention modules get the absorbed forward, its cache holds latents
    latent_attention: str | None = None
    # a family whose modules get forwards of ours beyond the attention function (models/<name>.py):
    # "llama4" (chunked attention, per-row query temperature, experts on router-scaled inputs); "zamba" (Zamba's
    # and Zamba2's hybrid layers' attention modules get their layer's index); "dory" (its looped attention);
    # "mamba" (an int8 output head that says the float dtype)
    own_forwards: str | None = None
    # the kv heads of its sliding-window layers, as a multiple of the config's (MiMo-V2-Flash: 2)
    sliding_kv_heads: int = 1
    # a family whose attention modules bypass transformers' AttentionInterface: on a StaticKVCache they run
    # a function of ours (models/<name>.py's fused_attention, through the registered attention function;
    # patch.py installs it) ("bloom", "falcon", "gpt_neo", "mpt", "xglm")
    own_attention: str | None = None
    # the kv heads of a config, where no config attribute says them (Falcon's depend on its layout)
    kv_heads_of: Callable | None = None
    # nn.Linear subclasses whose forward is nn.Linear's product x @ W.T + b (FalconLinear): int8 like nn.Linear
    linear_subclasses: tuple[str, ...] = ()
    # model code that sizes tensors by the cache's length before its layers (Falcon's and BLOOM's ALiBi tensors,
    # one entry per key, and BioGPT's and OPT's (before 5.18) masks when given none, against a mask of the fused
    # step's mask sizes; CTRL only reads it, for positions it is given): in fused steps the cache's
    # get_seq_length() says 0, transformers' view of a cache whose update returns the new tokens alone (as
    # its mask sizes and query offset say); the fused attention reads positions, not lengths
    fused_length_zero: bool = False
    # a hybrid's recurrent blocks' linear projections of their input, in the order they are called (Qwen3.5's
    # gated delta net: qkv, z, b, a): with int8 one Int8Linear (one launch a step) whose output they split
    recurrent_input_projections: tuple[str, ...] = ()
    # the config attribute with the number of positions a model's fixed position table holds (learned
    # position embeddings: GPT-2's wpe ...; CTRL's sinusoidal table): no token may sit past it (None: rotary,
    # ALiBi, or a table the model grows)
    position_table: str | None = None

    def __post_init__(self):
        if bool(self.compiles_from) != bool(self.compiles_from_reason):
            raise ValueError(f"Family {self.model_type!r}: compiles_from and compiles_from_reason go together "
                             f"(got {self.compiles_from!r} and {self.compiles_from_reason!r})")

    def layer_kinds(self, config) -> list[str]:
        """Per decoder layer: "attention" (keys and values), "recurrent" (a recurrent state, no keys /
        values), "both" (attention and a recurrent block side by side: Falcon-H1), "shared"
        (attention over another layer's keys and values, see kv_sources: Gemma 4's last layers) or
        "none" (an MLP or MoE block that is a layer of its own: no cache)."""
        shared = [mode == "reuse" for mode in kv_sharing_modes(config)]
        return [("shared" if reuses else "recurrent" if kind in self.recurrent_layer_types else
                 "none" if kind in CACHELESS else "both" if kind in PARALLEL else "attention")
                for kind, reuses in zip(layer_types(config), shared)]

    @property
    def experts_classes(self) -> tuple[str, ...]:
        """The experts module class names (empty for dense families)."""
        if self.experts_class is None:
            return ()
        return (self.experts_class,) if isinstance(self.experts_class, str) else self.experts_class

    def layer_geometry(self, config) -> list[tuple[int, ...]]:
        """Per decoder layer: (kv heads, head dim) for this family's config; (kv heads, head dim,
        value dim) where the values are the keys' first value-dim numbers (multi-head latent
        attention: the latent). A heterogeneous config (transformers' ``per_layer_config``: Gemma 4's
        global layers have their own) gives each layer its own; others give every layer the config's."""
        layer_configs = getattr(config, "per_layer_config", None)
        layer_configs = list(layer_configs) if layer_configs is not None else [config] * config.num_hidden_layers
        geometry = [self._geometry(layer_config) for layer_config in layer_configs[:config.num_hidden_layers]]
        if self.sliding_kv_heads != 1:
            geometry = [(layer[0] * self.sliding_kv_heads, *layer[1:]) if kind in SLIDING else layer
                        for layer, kind in zip(geometry, layer_types(config))]
        return geometry

    def _geometry(self, config) -> tuple[int, ...] | None:
        if self.attention_class is None:  # an attention-free family: no keys or values anywhere
            return None
        if self.latent_attention:  # one [latent, rope part] per token, shared by every head, values the latent
            return 1, config.kv_lora_rank + config.qk_rope_head_dim, config.kv_lora_rank
        heads = config.num_attention_heads
        kv_heads = getattr(config, self.kv_heads_attr, None) if self.kv_heads_attr else None
        if self.kv_heads_of is not None:
            kv_heads = self.kv_heads_of(config)
        head_dim = getattr(config, self.head_dim_attr, None) if self.head_dim_attr else None
        return kv_heads or heads, head_dim or config.hidden_size // heads

    def check_compile(self, model) -> None:
        """ValueError, naming ``compile``, if the installed transformers' model code for this family
        cannot be traced by torch.compile, or ``model`` kept float experts that cannot be."""
        if not self.float_experts_compile and any(type(m).__name__ in self.experts_classes for m in model.modules()):
            raise ValueError(f"compile=True: {self.model_type}'s float experts loop over the routed experts in Python "
                             "(a data-dependent trip count), which torch.compile cannot trace in one graph; "
                             "patch_model(int8=True) makes them Int8Experts, which compile (or pass compile=False)")
        if self.compile_blocker:
            raise ValueError(f"compile=True: transformers' {self.model_type} models {self.compile_blocker}, which "
                             "torch.compile cannot trace (pass compile=False)")
        if self.compiles_from and transformers_before(self.compiles_from):
            raise ValueError(f"compile=True: transformers {transformers.__version__}'s {self.model_type} models "
                             f"{self.compiles_from_reason}, which torch.compile cannot trace; it works from "
                             f"transformers {self.compiles_from} on (upgrade, or pass compile=False)")

    def check_config(self, config) -> None:
        for flag in ("add_cross_attention", *self.refused_flags):
            name, _, refused = flag.partition("=")
            value = getattr(config, name, None)
            if (value == refused) if refused else bool(value):
                raise ValueError(f"{self.model_type} models with {name}={value!r} are not supported (the fused "
                                 "attention is causal self-attention over the cache)")


# the layer_types of layers with a recurrent state, and of layers without any cache (a hybrid's MLP or
# MoE blocks that are layers of their own), as transformers' configs name them
RECURRENT = ("linear_attention", "mamba", "conv")
CACHELESS = ("mlp", "moe")
# and of layers running attention and a recurrent block side by side (Falcon-H1's; ZAYA1's, some windowed)
PARALLEL = ("hybrid", "hybrid_sliding")
# and of layers attending through the config's sliding_window
SLIDING = ("sliding_attention", "hybrid_sliding")
# the first transformers release whose hybrid models work on a StaticKVCache (tested: 5.17 and 5.23;
# in 5.8 to 5.14 some read other state attributes, or restart a state on multi-token inputs)
HYBRID_FROM = "5.17"
# a gated delta net's input projections (Qwen3.5's, LaraMini's), as Family.recurrent_input_projections
GATED_DELTA = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family("llama", "LlamaAttention", "num_key_value_heads", "head_dim", "LlamaMLP"),
        Family("mistral", "MistralAttention", "num_key_value_heads", "head_dim", "MistralMLP"),
        Family("qwen2", "Qwen2Attention", "num_key_value_heads", "head_dim", "Qwen2MLP"),
        Family("qwen3", "Qwen3Attention", "num_key_value_heads", "head_dim", "Qwen3MLP"),
        Family("gemma", "GemmaAttention", "num_key_value_heads", "head_dim", "GemmaMLP"),
        # local (sliding-window) and global layers alternate; Gemma 2 soft-caps attention scores
        Family("gemma2", "Gemma2Attention", "num_key_value_heads", "head_dim", "Gemma2MLP"),
        Family("gemma3_text", "Gemma3Attention", "num_key_value_heads", "head_dim", "Gemma3MLP",
               refused_flags=("use_bidirectional_attention",)),
        Family("olmo2", "Olmo2Attention", "num_key_value_heads", "head_dim", "Olmo2MLP"),
        Family("granite", "GraniteAttention", "num_key_value_heads", "head_dim", "GraniteMLP"),
        Family("cohere", "CohereAttention", "num_key_value_heads", "head_dim", "CohereMLP"),
        Family("olmo", "OlmoAttention", "num_key_value_heads", "head_dim", "OlmoMLP"),
        Family("helium", "HeliumAttention", "num_key_value_heads", "head_dim", "HeliumMLP"),
        Family("smollm3", "SmolLM3Attention", "num_key_value_heads", "head_dim", "SmolLM3MLP"),
        # mixture of experts: routers stay float, experts become Int8Experts (Qwen2-MoE's shared expert
        # and Qwen3-MoE's dense layers are gated MLPs)
        Family("mixtral", "MixtralAttention", "num_key_value_heads", "head_dim", experts_class="MixtralExperts"),
        Family("qwen2_moe", "Qwen2MoeAttention", "num_key_value_heads", "head_dim", "Qwen2MoeMLP",
               experts_class="Qwen2MoeExperts", window_in_mask=True),
        Family("qwen3_moe", "Qwen3MoeAttention", "num_key_value_heads", "head_dim", "Qwen3MoeMLP",
               experts_class="Qwen3MoeExperts"),
        Family("olmoe", "OlmoeAttention", "num_key_value_heads", "head_dim", experts_class="OlmoeExperts"),
        # (transformers 5.8's GraniteMoE experts, ParallelExperts, are a layout Int8Experts does not reproduce: named
        # so that patch_model warns they stay float)
        Family("granitemoe", "GraniteMoeAttention", "num_key_value_heads", "head_dim",
               experts_class=("GraniteMoeExperts", "GraniteMoeParallelExperts")),
        Family("glm4_moe", "Glm4MoeAttention", "num_key_value_heads", "head_dim", "Glm4MoeMLP",
               experts_class=("Glm4MoeExperts", "Glm4MoeNaiveMoe")),  # the latter in transformers 5.8
        # a config of its own over transformers' GLM-4-MoE model (full rotary, q / k norms)
        Family("sarvam_moe", "Glm4MoeAttention", "num_key_value_heads", "head_dim", "Glm4MoeMLP",
               experts_class="Glm4MoeExperts"),
        Family("ernie4_5_moe", "Ernie4_5_MoeAttention", "num_key_value_heads", "head_dim", "Ernie4_5_MoeMLP",
               experts_class="Ernie4_5_MoeExperts"),
        Family("flex_olmo", "FlexOlmoAttention", "num_key_value_heads", "head_dim", experts_class="FlexOlmoExperts"),
        Family("granitemoeshared", "GraniteMoeSharedAttention", "num_key_value_heads", "head_dim",
               experts_class=("GraniteMoeSharedExperts", "GraniteMoeSharedParallelExperts")),
        Family("minimax_m2", "MiniMaxM2Attention", "num_key_value_heads", "head_dim", experts_class="MiniMaxM2Experts"),
        Family("solar_open", "SolarOpenAttention", "num_key_value_heads", "head_dim", "SolarOpenMLP",
               experts_class=("SolarOpenExperts", "SolarOpenNaiveMoe")),  # the latter in transformers 5.8
        Family("dots1", "Dots1Attention", "num_key_value_heads", "head_dim", "Dots1MLP",
               experts_class=("Dots1Experts", "Dots1NaiveMoe")),  # the latter in transformers 5.8
        # its router is an nn.Linear (wg) whose weight dtype the model reads: it stays float
        Family("hunyuan_v1_moe", "HunYuanMoEV1Attention", "num_key_value_heads", "head_dim", "HunYuanMoEV1MLP",
               experts_class="HunYuanMoEV1Experts", float_linears=("*.mlp.gate.wg",)),
        # mixture of experts with local (sliding-window) and global layers
        Family("exaone_moe", "ExaoneMoeAttention", "num_key_value_heads", "head_dim", "ExaoneMoeMLP",
               experts_class="ExaoneMoeExperts"),
        Family("cohere2_moe", "Cohere2MoeAttention", "num_key_value_heads", "head_dim", "Cohere2MoeMLP",
               experts_class="Cohere2MoeExperts"),
        Family("laguna", "LagunaAttention", "num_key_value_heads", "head_dim", "LagunaMLP",
               experts_class="LagunaExperts"),
        Family("mellum", "MellumAttention", "num_key_value_heads", "head_dim", "MellumMLP",
               experts_class="MellumExperts"),
        Family("granitemoe_swa", "GraniteMoeSWAAttention", "num_key_value_heads", "head_dim",
               experts_class="GraniteMoeSWAExperts"),
        Family("afmoe", "AfmoeAttention", "num_key_value_heads", "head_dim", "AfmoeMLP", experts_class="AfmoeExperts",
               float_linears=("*.mlp.router.gate",)),  # the router's nn.Linear stays float
        # attention sinks, local / global layers; experts biased, transposed, gate / up interleaved, its
        # own clamped gate (Int8Experts runs it)
        Family("gpt_oss", "GptOssAttention", "num_key_value_heads", "head_dim", experts_class="GptOssExperts"),
        # values narrower than the keys (v_head_dim 128 against head_dim 192: the cache keeps them zero-padded
        # to the keys' width, models/attention.py), twice the kv heads and attention sinks on the local
        # layers, partial rotary, values scaled before the cache; DeepSeek-style routed experts
        Family("mimo_v2_flash", "MiMoV2FlashAttention", "num_key_value_heads", "head_dim", "MiMoV2FlashMLP",
               experts_class="MiMoV2FlashExperts", sliding_kv_heads=2),
        # routers with a score-correction bias (HY-V3) or local / global layers and shared experts (Kolibri);
        # Flint: also attention sinks, and RoPE on its local layers only
        Family("hy_v3", "HYV3Attention", "num_key_value_heads", "head_dim", "HYV3MLP", experts_class="HYV3Experts"),
        Family("kolibri1", "Kolibri1Attention", "num_key_value_heads", "head_dim", "Kolibri1MLP",
               experts_class="Kolibri1Experts"),
        Family("flint", "FlintAttention", "num_key_value_heads", "head_dim", "FlintMLP", experts_class="FlintExperts"),
        # sliding-window layers with RoPE, full-attention layers without (NoPE) with queries scaled by position; a
        # sigmoid gate per head (biased) on the attention output; MLPs and experts gate in float32; grouped routing
        Family("beam", "BeamAttention", "num_key_value_heads", "head_dim", "BeamMLP", experts_class="BeamExperts",
               gated_mlp_in_float32=True),
        # (before 5.18 its experts are two grouped GEMM modules, which Int8Experts does not reproduce: they
        # stay float, and loop over the experts in Python)
        Family("aria_text", "AriaTextAttention", "num_key_value_heads", "head_dim", "AriaSharedExpertsMLP",
               experts_class="AriaExperts", compiles_from="5.18",
               compiles_from_reason="run their experts (float: Int8Experts does not reproduce these) as a Python "
                                    "loop over data-dependent slices"),
        # local (sliding-window) and global layers
        # per-layer head dims and kv heads (global layers: 512, some with keys as values), the last layers
        # attending over earlier layers' keys and values, per-layer embeddings, experts beside the MLP
        # (before 5.17 its configs have no per_layer_config, which gives the global layers' geometry)
        Family("gemma4_text", "Gemma4TextAttention", "num_key_value_heads", "head_dim", "Gemma4TextMLP",
               experts_class="Gemma4TextExperts", float_linears=("*.router.proj",), supported_from="5.17",
               refused_flags=("use_bidirectional_attention=all",)),  # ("vision": for image tokens alone)
        # Gemma 4 unified's text decoder: Gemma 4's attention, KV sharing and double-wide MLPs, without
        # per-layer embeddings or experts
        Family("gemma4_unified_text", "Gemma4UnifiedTextAttention", "num_key_value_heads", "head_dim",
               "Gemma4UnifiedTextMLP", refused_flags=("use_bidirectional_attention=all",)),
        # Gemma 3n's text decoder: Gemma 4's KV sharing, value norms, AltUp, LAuReL, per-layer embeddings, and
        # MLPs whose gate is sparsified (a Gaussian top-k) in the first layers. AltUp's router and its
        # coefficient maps (hidden x 4, 4 x 16, 4 x 4) stay float: they weight whole hidden-state streams
        Family("gemma3n_text", "Gemma3nTextAttention", "num_key_value_heads", "head_dim", "Gemma3nTextMLP",
               float_linears=("*.altup.*",)),
        Family("cohere2", "Cohere2Attention", "num_key_value_heads", "head_dim", "Cohere2MLP"),
        # Cohere Compass's text decoder: Cohere 2's attention, RoPE per layer type (M-RoPE sections, whose
        # axes agree for text) or none
        Family("cohere_compass_text", "CohereCompassAttention", "num_key_value_heads", "head_dim", "CohereCompassMLP"),
        Family("cwm", "CwmAttention", "num_key_value_heads", "head_dim", "CwmMLP"),
        Family("vaultgemma", "VaultGemmaAttention", "num_key_value_heads", "head_dim", "VaultGemmaMLP"),  # soft-caps
        Family("granite_swa", "GraniteSWAAttention", "num_key_value_heads", "head_dim", "GraniteSWAMLP"),  # sinks
        Family("olmo3", "Olmo3Attention", "num_key_value_heads", "head_dim", "Olmo3MLP"),
        Family("ministral", "MinistralAttention", "num_key_value_heads", "head_dim", "MinistralMLP"),
        Family("exaone4", "Exaone4Attention", "num_key_value_heads", "head_dim", "Exaone4MLP"),
        # more Llama-like decoders
        Family("seed_oss", "SeedOssAttention", "num_key_value_heads", "head_dim", "SeedOssMLP"),
        Family("ernie4_5", "Ernie4_5Attention", "num_key_value_heads", "head_dim", "Ernie4_5MLP"),
        Family("hunyuan_v1_dense", "HunYuanDenseV1Attention", "num_key_value_heads", "head_dim", "HunYuanDenseV1MLP"),
        Family("hyperclovax", "HyperCLOVAXAttention", "num_key_value_heads", "head_dim", "HyperCLOVAXMLP"),
        # query scaled by position (Llama-4 style)
        Family("ministral3", "Ministral3Attention", "num_key_value_heads", "head_dim", "Ministral3MLP"),
        # configs of their own over transformers' Llama model
        Family("internlm3", "LlamaAttention", "num_key_value_heads", "head_dim", "LlamaMLP"),
        Family("iquestcoder", "LlamaAttention", "num_key_value_heads", "head_dim", "LlamaMLP"),
        Family("exaone", "LlamaAttention", "num_key_value_heads", "head_dim", "LlamaMLP"),
        Family("glm4", "Glm4Attention", "num_key_value_heads", "head_dim"),   # gate / up fused already
        Family("arcee", "ArceeAttention", "num_key_value_heads", "head_dim"),  # ungated MLP
        Family("apertus", "ApertusAttention", "num_key_value_heads", "head_dim"),  # ungated xIELU MLP
        Family("jais2", "Jais2Attention", "num_key_value_heads", "head_dim"),  # ungated, LayerNorms, biases
        Family("nanochat", "NanoChatAttention", "num_key_value_heads", "head_dim"),  # ungated, weightless norms
        Family("bitnet", "BitNetAttention", "num_key_value_heads", "head_dim"),  # norms inside attention and MLP
        # Apertus 1.5's text decoder: Apertus with an output head that may be pruned to a vocabulary prefix
        Family("apertus1p5_text", "Apertus1p5TextAttention", "num_key_value_heads", "head_dim"),
        # Phi-3 and GLM project gate / up as one Linear already (Phi-3 q / k / v too)
        # multi-head latent attention (kv_b_proj int8 too: its per-head weights absorbed, latent_attention.py)
        # (its router: an nn.Linear whose weight the model reads in transformers 5.8, a module of its own later)
        Family("deepseek_v2", "DeepseekV2Attention", None, None, "DeepseekV2MLP", experts_class="DeepseekV2Experts",
               float_linears=("*.mlp.gate",), latent_attention="complex"),
        Family("deepseek_v3", "DeepseekV3Attention", None, None, "DeepseekV3MLP",
               experts_class=("DeepseekV3Experts", "DeepseekV3NaiveMoe"),  # the latter in transformers 5.8
               latent_attention="cos_sin"),
        Family("glm4_moe_lite", "Glm4MoeLiteAttention", None, None, "Glm4MoeLiteMLP",
               experts_class=("Glm4MoeLiteExperts", "Glm4MoeLiteNaiveMoe"),  # the latter in transformers 5.8
               latent_attention="cos_sin"),
        Family("minicpm3", "MiniCPM3Attention", None, None, "MiniCPM3MLP", latent_attention="cos_sin"),
        Family("youtu", "YoutuAttention", None, None, "YoutuMLP", latent_attention="cos_sin"),
        Family("axk1", "AXK1Attention", None, None, "AXK1MLP", experts_class="AXK1Experts",
               latent_attention="cos_sin"),
        # a config of its own over transformers' DeepSeek-V3 model (its releases: a full-rank q_proj)
        Family("sarvam_mla", "DeepseekV3Attention", None, None, "DeepseekV3MLP", experts_class="DeepseekV3Experts",
               latent_attention="cos_sin"),
        # chunked attention on its RoPE layers, query temperature on its NoPE layers, top-1 experts on
        # router-scaled inputs beside a shared expert (models/llama4.py)
        Family("llama4_text", "Llama4TextAttention", "num_key_value_heads", "head_dim", "Llama4TextMLP",
               experts_class="Llama4TextExperts", own_forwards="llama4"),
        Family("phi3", "Phi3Attention", "num_key_value_heads", "head_dim"),
        Family("glm", "GlmAttention", "num_key_value_heads", "head_dim"),
        # plain (ungated) MLPs
        Family("phi", "PhiAttention", "num_key_value_heads", "head_dim"),
        Family("starcoder2", "Starcoder2Attention", "num_key_value_heads", "head_dim"),
        # hybrid: layers with a recurrent state (linear attention: gated delta nets, Mamba; short
        # convolutions) between full-attention layers; the cache holds transformers' state layers there
        Family("qwen3_5_text", "Qwen3_5Attention", "num_key_value_heads", "head_dim", "Qwen3_5MLP",
               recurrent_layer_types=RECURRENT, supported_from=HYBRID_FROM, recurrent_input_projections=GATED_DELTA),
        Family("qwen3_5_moe_text", "Qwen3_5MoeAttention", "num_key_value_heads", "head_dim", "Qwen3_5MoeMLP",
               experts_class="Qwen3_5MoeExperts", recurrent_layer_types=RECURRENT, supported_from=HYBRID_FROM,
               recurrent_input_projections=GATED_DELTA),
        Family("qwen3_next", "Qwen3NextAttention", "num_key_value_heads", "head_dim", "Qwen3NextMLP",
               experts_class="Qwen3NextExperts", recurrent_layer_types=RECURRENT, supported_from=HYBRID_FROM,
               recurrent_input_projections=("in_proj_qkvz", "in_proj_ba")),
        Family("olmo_hybrid", "OlmoHybridAttention", "num_key_value_heads", "head_dim", "OlmoHybridMLP",
               recurrent_layer_types=RECURRENT, supported_from=HYBRID_FROM,
               recurrent_input_projections=("q_proj", "k_proj", "v_proj", "b_proj", "a_proj", "g_proj")),
        # and sliding-window layers with RoPE, full-attention layers without (NoPE); experts beside a shared expert
        Family("lara_mini", "LaraMiniAttention", "num_key_value_heads", "head_dim", "LaraMiniMLP",
               experts_class="LaraMiniExperts", recurrent_layer_types=RECURRENT, supported_from=HYBRID_FROM,
               recurrent_input_projections=GATED_DELTA),
        # Mamba layers; Jamba's reads its dt_proj's weight, which stays float, as does its router (an
        # nn.Linear before transformers 5.18)
        Family("jamba", "JambaAttention", "num_key_value_heads", "head_dim", "JambaMLP", experts_class="JambaExperts",
               recurrent_layer_types=RECURRENT, supported_from=HYBRID_FROM,
               float_linears=("*.mamba.dt_proj", "*.feed_forward.router")),
        Family("bamba", "BambaAttention", "num_key_value_heads", "head_dim", "BambaMLP",
               recurrent_layer_types=RECURRENT, supported_from=HYBRID_FROM),
        Family("granitemoehybrid", "GraniteMoeHybridAttention", "num_key_value_heads", "head_dim",
               experts_class="GraniteMoeHybridExperts", recurrent_layer_types=RECURRENT, supported_from=HYBRID_FROM),
        # Mamba-2 layers, and MLP / MoE blocks as layers of their own
        Family("nemotron_h", "NemotronHAttention", "num_key_value_heads", "head_dim",
               experts_class="NemotronHExperts", recurrent_layer_types=RECURRENT, supported_from=HYBRID_FROM),
        # short convolutions
        Family("lfm2", "Lfm2Attention", "num_key_value_heads", "head_dim", recurrent_layer_types=RECURRENT,
               supported_from=HYBRID_FROM),
        Family("lfm2_moe", "Lfm2MoeAttention", "num_key_value_heads", "head_dim", experts_class="Lfm2MoeExperts",
               recurrent_layer_types=RECURRENT, supported_from=HYBRID_FROM),
        # and sliding-window layers, a sigmoid gate per head on the attention output
        Family("lfm3", "Lfm3Attention", "num_key_value_heads", "head_dim", recurrent_layer_types=RECURRENT,
               supported_from=HYBRID_FROM),
        # Kimi Delta Attention (linear) layers between MLA layers without positions (NoPE); experts
        Family("kimi_linear", "KimiLinearAttention", None, None, "KimiLinearMLP", experts_class="KimiLinearExperts",
               latent_attention="none", recurrent_layer_types=RECURRENT, supported_from=HYBRID_FROM,
               recurrent_input_projections=("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj")),
        # attention and Mamba-2 side by side in every layer; muP multipliers (its MLP's gate is scaled
        # before the activation, so gate and up are not fused)
        Family("falcon_h1", "FalconH1Attention", "num_key_value_heads", "head_dim",
               recurrent_layer_types=RECURRENT, supported_from=HYBRID_FROM),
        # compressed convolutional attention (ZAYA1): q / k through a causal convolution, half of each value
        # head from the token before, so every layer keeps keys / values and transformers' conv and
        # recurrent states ("hybrid", "hybrid_sliding"); top-1 experts or a skip, routed by a float MLP
        Family("zaya", "ZayaAttention", "num_key_value_heads", "head_dim", experts_class="ZayaExperts",
               float_linears=("*.mlp.gate.*",), recurrent_layer_types=RECURRENT, supported_from=HYBRID_FROM,
               recurrent_input_projections=("q_proj", "k_proj", "v_proj_current", "v_proj_delayed")),
        # attention-free: every layer a Mamba (selective state-space) block; the cache holds transformers' conv
        # and recurrent states alone. Their models cast the hidden states to lm_head.weight's dtype (models/mamba.py:
        # the int8 head says it), and Mamba's and Falcon-Mamba's mixers multiply by dt_proj.weight (stays float)
        Family("mamba", None, None, None, recurrent_layer_types=RECURRENT, supported_from=HYBRID_FROM,
               float_linears=("*.mixer.dt_proj",), own_forwards="mamba"),
        Family("falcon_mamba", None, None, None, recurrent_layer_types=RECURRENT, supported_from=HYBRID_FROM,
               float_linears=("*.mixer.dt_proj",), own_forwards="mamba"),
        Family("mamba2", None, None, None, recurrent_layer_types=RECURRENT, supported_from=HYBRID_FROM,
               own_forwards="mamba"),
        # Mamba-2 layers, some ("hybrid") after a shared transformer block (attention over the hidden state and the
        # token embeddings side by side, a fused gate / up MLP; per-use low-rank adapters): models/zamba.py
        Family("zamba2", "Zamba2Attention", "num_key_value_heads", "attention_head_dim",
               recurrent_layer_types=RECURRENT, supported_from=HYBRID_FROM, own_forwards="zamba"),
        # the same with Mamba layers (per-head x / dt projections) and one shared block
        Family("zamba", "ZambaAttention", "num_key_value_heads", "attention_head_dim", "ZambaMLP",
               recurrent_layer_types=RECURRENT, supported_from=HYBRID_FROM, own_forwards="zamba"),
        # nGPT (unit-norm hidden states, queries and keys), local / global layers, a recurrent section of layers run
        # several times, per run with keys and values of its own or the last run's (models/dory.py); its MLP scales
        # gate and up before the activation (not fused), its output head scales its logits (int8: Int8DoryLMHead)
        Family("dory", "DoryAttention", "num_key_value_heads", "head_dim", own_forwards="dory"),
        Family("gpt2", "GPT2Attention", None, None, position_table="n_positions"),
        # one KV head (multi_query)
        Family("gpt_bigcode", "GPTBigCodeAttention", "num_key_value_heads", None, position_table="n_positions"),
        # learned positions; before 5.18 its model sizes a mask by the cache length (fused_length_zero makes it
        # the step's, traceable)
        Family("opt", "OPTAttention", None, None, fused_length_zero=True, position_table="max_position_embeddings"),
        Family("persimmon", "PersimmonAttention", None, None),  # partial rotary, q / k LayerNorms
        # partial rotary; optional per-head q / k LayerNorms and parallel residual; layers drop the keywords
        Family("stablelm", "StableLmAttention", "num_key_value_heads", None, layers_drop_keywords=True),
        # partial rotary, LayerNorm1P, ungated ReLU^2 MLP; layers drop the keywords; before 5.13 its
        # attention classes bypass the attention interface
        Family("nemotron", "NemotronAttention", "num_key_value_heads", "head_dim", layers_drop_keywords=True,
               supported_from="5.13"),
        Family("gpt_neox", "GPTNeoXAttention", None, None),
        # one fused q / k / v projection in one of three layouts (models/falcon.py: its attention bypasses the
        # attention interface and its layers drop the keywords), attention and MLP in parallel; ALiBi (Falcon-RW)
        Family("falcon", "FalconAttention", None, None, own_attention="falcon", kv_heads_of=falcon_kv_heads,
               layers_drop_keywords=True, linear_subclasses=("FalconLinear",), fused_length_zero=True),
        # unscaled scores, local (windowed) and global layers, learned positions (models/gpt_neo.py: its attention
        # bypasses the attention interface and its wrapper drops the keywords)
        Family("gpt_neo", "GPTNeoSelfAttention", None, None, own_attention="gpt_neo", layers_drop_keywords=True,
               position_table="max_position_embeddings"),
        # ALiBi (models/bloom.py, models/mpt.py: their attention bypasses the attention interface and adds the bias
        # itself; their layers drop the keywords)
        Family("bloom", "BloomAttention", None, None, own_attention="bloom", layers_drop_keywords=True,
               fused_length_zero=True),
        Family("mpt", "MptAttention", None, None, own_attention="mpt", layers_drop_keywords=True),
        # sinusoidal positions, scaled embeddings (models/xglm.py: its attention bypasses the attention interface);
        # its model grows its position table by the cache's length: in fused steps it sees 0 (so the step traces
        # before 5.20 too, and reads no length back), and models/xglm.py grows the table to the cache's length
        Family("xglm", "XGLMAttention", None, None, own_attention="xglm", fused_length_zero=True),
        # interleaved partial rotary (rotary_dim), attention and MLP in parallel (GPT-J); CodeGen's q / k / v
        # one Linear in model-parallel blocks. Before 5.24 their attention bypassed the attention interface
        Family("gptj", "GPTJAttention", None, None, supported_from="5.24"),
        Family("codegen", "CodeGenAttention", None, None, supported_from="5.24"),
        # learned positions (BioGPT: offset by 2, scaled embeddings); CTRL: sinusoidal positions
        Family("biogpt", "BioGptAttention", None, None, fused_length_zero=True,
               position_table="max_position_embeddings"),
        # (before 5.13 CTRL's attention bypassed the attention interface)
        Family("ctrl", "MultiHeadAttention", None, None, supported_from="5.13", fused_length_zero=True,
               compile_blocker="re-register their position encodings as a buffer in every forward",
               position_table="n_positions"),
        # local (sliding-window) and global layers
        Family("modernbert-decoder", "ModernBertDecoderAttention", None, None),
        # sparsemixer top-2 routing; its router subclasses nn.Linear with a forward of its own, which
        # int8 leaves float like every router
        Family("phimoe", "PhimoeAttention", "num_key_value_heads", "head_dim", experts_class="PhimoeExperts",
               window_in_mask=True),
        # mixture of experts as three 2-D weights (Int8Experts reads them), clipped q / k / v; the router's
        # nn.Linear stays float. Before 5.17 (tested: 5.8 to 5.14) transformers sized that router by the
        # experts' hidden size, not the model's: DBRX models did not run there
        Family("dbrx", "DbrxAttention", "num_key_value_heads", None, experts_class="DbrxExperts",
               float_linears=("*.ffn.router.layer",), float_experts_compile=False, supported_from="5.17"),
    )
}


def family_of(config) -> Family:
    """The Family of a (decoder) config; ValueError naming the supported families otherwise."""
    text_config = config.get_text_config(decoder=True)
    if text_config is not config and getattr(config, "model_type", None) not in FAMILIES:
        raise ValueError(f"gptfast_kernels supports text-only causal language models; {config.model_type!r} wraps "
                         f"a {text_config.model_type!r} text model (load the text model alone, e.g. "
                         "AutoModelForCausalLM on a text-only checkpoint)")
    config = text_config
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"gptfast_kernels does not support model_type {model_type!r}; supported model "
                         f"families: {', '.join(sorted(FAMILIES))}")
    if family.supported_from and transformers_before(family.supported_from):
        raise ValueError(f"gptfast_kernels supports {model_type} models from transformers {family.supported_from} on "
                         f"(installed: {transformers.__version__}); upgrade transformers")
    family.check_config(config)
    return family
