"""Drafting with a Gemma 4 assistant, batched.

Google pairs Gemma 4 checkpoints with small assistant models (``Gemma4AssistantForCausalLM``,
``Gemma4UnifiedAssistantForCausalLM``) that draft without a cache of their own: every assistant
layer attends over the keys and values the target already holds, those of the target's last
non-sharing layer of its type ("store" in the config's kv_sharing_modes), and its query sits at
the position of the last token the target emitted, for every draft of a round. Its input is that
token's embedding (the target's embedding table) next to a hidden state: the target's last hidden
state first, then its own output projected back (``post_projection``). transformers drafts with it
for one row (``generate(assistant_model=...)``). Passed to ``speculative_generate`` as the draft
model, it drafts here for every row of a batch, in an AssistantProposer:

- Its layers read the target's StaticKVCache buffers directly: every committed position of the
  row (0 .. p - 1 for a query at position p, the row's length), the last W + 1 of them in a
  sliding-window layer of window W (transformers' flipped bidirectional window mask). A ring
  buffer maps its slots back to the positions they hold; positions past the row's length
  (rejected drafts) are never read.
- After verification, the hidden state is the target's at the last accepted position.
- With ``use_ordered_embeddings`` the logits come from the assistant's centroid head: its chosen
  clusters' tokens get their scores, every other token the row's lowest score minus one
  (transformers takes that floor over the whole batch, which would make a row's distribution
  depend on the others).

transformers differs in one respect, which this module does not copy: after a round it crops the
target's keys and values to the text's length, which keeps the key of the rejected draft at the
last emitted token's position (and in a sliding layer, every rejected draft) in what the assistant
attends over. Here the assistant sees the committed text alone, as after the prompt.

Everything stays on the device. Compiled, a round's k drafts are one call (CUDA graphs), as a draft
model's are (its forwards and the picks between them).
The assistant runs transformers' own modules in its own dtype; ``quantize_int8_(assistant)`` makes
its linear layers int8 (the output head stays float by default, which the centroid head reads).
"""

from __future__ import annotations

import functools

import torch

from gptfast_kernels.generation import common
from gptfast_kernels.generation.forward import compiled_function, picked_drafts
from gptfast_kernels.models import families

ASSISTANT_CLASSES = ("Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM")


def is_gemma4_assistant(module) -> bool:
    """Whether ``module`` is a Gemma 4 assistant (a drafter over the target's keys and values)."""
    return type(module).__name__ in ASSISTANT_CLASSES


def kv_geometry(config, index: int) -> tuple[int, int]:
    """(kv heads, head dim) of layer ``index`` of a Gemma 4 text config."""
    per_layer = getattr(config, "per_layer_config", None)
    if per_layer is not None:
        layer = per_layer[index]
        return int(layer.num_key_value_heads), int(layer.head_dim)
    if config.layer_types[index] == "full_attention" and getattr(config, "global_head_dim", None):
        heads = getattr(config, "num_global_key_value_heads", None) or config.num_key_value_heads
        return int(heads), int(config.global_head_dim)
    return int(config.num_key_value_heads), int(config.head_dim)


def source_layers(model) -> dict[str, int]:
    """Per layer type of ``model`` (a Gemma 4 text model): the last layer of that type that keeps
    keys and values of its own, whose keys and values an assistant's layers of that type read."""
    config = model.config.get_text_config(decoder=True)
    modes = families.kv_sharing_modes(config)  # (configs before transformers 5.23 have none)
    sources = {}
    for index, (kind, mode) in enumerate(zip(config.layer_types, modes)):
        if mode != "reuse":
            sources[kind] = index
    return sources


def check_assistant(op: str, model, assistant) -> None:
    """ValueError unless ``assistant`` (a Gemma 4 assistant) can draft for ``model`` here."""
    if not hasattr(assistant, "pre_projection") or not hasattr(assistant, "post_projection"):
        raise TypeError(f"{op}: draft_model is a {type(assistant).__name__} without pre_projection / "
                        "post_projection; only transformers' Gemma 4 assistants draft over the target's cache")
    target = model.config.get_text_config(decoder=True)
    if not str(getattr(target, "model_type", "")).startswith("gemma4"):
        raise ValueError(f"{op}: draft_model is a Gemma 4 assistant, which drafts over a Gemma 4 model's keys and "
                         f"values; model is a {getattr(target, 'model_type', type(model).__name__)!r} model")
    text = assistant.config.get_text_config()
    backbone = assistant.config.backbone_hidden_size
    if backbone != target.hidden_size:
        raise ValueError(f"{op}: draft_model (a Gemma 4 assistant) has backbone_hidden_size {backbone} but model "
                         f"has hidden_size {target.hidden_size}; the assistant must be the model's own")
    if text.vocab_size != target.vocab_size:
        raise ValueError(f"{op}: draft_model (a Gemma 4 assistant) has vocab_size {text.vocab_size} but model has "
                         f"{target.vocab_size}")
    sources = source_layers(model)
    for index, kind in enumerate(text.layer_types):
        if kind not in sources:
            raise ValueError(f"{op}: draft_model's layer {index} is a {kind!r} layer, but model has no such layer "
                             "with keys and values of its own")
        ours, theirs = kv_geometry(text, index), kv_geometry(target, sources[kind])
        if ours != theirs:
            raise ValueError(f"{op}: draft_model's layer {index} ({kind}) attends with (kv heads, head dim) {ours}, "
                             f"but model's layer {sources[kind]} holds keys and values of {theirs}")
    common.check_same_device(op, model, assistant)
    _, dtype = common.model_device_dtype(model)
    _, draft_dtype = common.model_device_dtype(assistant)
    if draft_dtype != dtype:
        raise ValueError(f"{op}: draft_model is {draft_dtype} but model is {dtype}; the assistant attends over the "
                         "model's keys and values, in its dtype (cast the assistant: draft_model.to(dtype))")


def ordered_logits(embedder, hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """A Gemma 4 assistant's centroid head, per row: hidden [B, T, H] -> logits [B, T, V]: the
    tokens of the ``centroid_intermediate_top_k`` clusters the centroids choose get their scores
    (hidden . the head's row), every other token its row's lowest score minus one."""
    B, T, H = hidden.shape
    clusters = embedder.centroids(hidden).topk(embedder.centroid_intermediate_top_k, dim=-1).indices
    members = embedder.token_ordering.long().view(embedder.num_centroids, -1)[clusters].reshape(B, T, -1)
    scores = (head_weight[members] @ hidden[..., None]).squeeze(-1)  # [B, T, top_k * V / clusters]
    floor = scores.amin(dim=-1, keepdim=True) - 1
    return floor.expand(B, T, embedder.vocab_size).contiguous().scatter_(-1, members, scores)


def _assistant_forward(tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, masks: dict,
                       shared: dict, embed, assistant=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft: tokens [B] (the token before, embedded by the target's ``embed``), hidden [B, H]
    (the state before it) at query positions [B], attending over ``shared`` (per layer type: the
    target's key / value buffers) where ``masks`` (per layer type: [B, 1, 1, S] bool) ->
    (logits [B, V], next hidden [B, H])."""
    embedded = embed(tokens[:, None])
    inputs = torch.cat([embedded, hidden[:, None].to(embedded.dtype)], dim=-1)
    out = assistant.model(inputs_embeds=assistant.pre_projection(inputs), attention_mask=masks,
                          position_ids=positions[:, None], shared_kv_states=dict(shared), use_cache=False)
    state = out.last_hidden_state
    if assistant.config.use_ordered_embeddings:
        logits = ordered_logits(assistant.masked_embedding, state, assistant.lm_head.weight)
    else:
        logits = assistant.lm_head(state)
    return logits[:, 0], assistant.post_projection(state)[:, 0]


def _assistant_drafts(last: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, masks: dict, shared: dict,
                      embed, k: int, sampling: tuple | None, processing,
                      assistant=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A round's k drafts per row in one call: the assistant over ``last`` [B] (the token the target
    emitted last) and ``hidden`` [B, H], then k - 1 times over the draft before and its own output
    state, every query at ``positions`` [B] (see _assistant_forward), each draft picked as
    forward.picked_drafts picks (``sampling``, ``processing``) -> (drafts [B, k], their
    distributions [B, k, V] or None when greedy)."""
    logits, state = _assistant_forward(last, hidden, positions, masks, shared, embed, assistant=assistant)

    def advance(token):
        nonlocal state
        next_logits, state = _assistant_forward(token, state, positions, masks, shared, embed, assistant=assistant)
        return next_logits

    return picked_drafts(logits, advance, k, sampling, processing)


def assistant_step_function(assistant, compile: bool):
    """_assistant_forward on ``assistant``, eager or compiled (as generation.forward.step_function;
    the compile check is its text model's family's)."""
    if not compile:
        return functools.partial(_assistant_forward, assistant=assistant)
    return compiled_function(assistant, _assistant_forward, "assistant_forward",
                             family_model=assistant.model)


class AssistantProposer:
    """Proposals from a Gemma 4 assistant (see the module docstring). Between rounds it holds each
    row's hidden state ``hidden`` [B, H]: the target's at the row's last committed position."""

    takes_target_hidden = True

    def __init__(self, assistant, model, target_cache, compile: bool, k: int):
        self.assistant, self.cache = assistant, target_cache
        text = assistant.config.get_text_config()
        sources = source_layers(model)
        self.shared, self.windows = {}, {}
        for kind in dict.fromkeys(text.layer_types):
            layer = target_cache.layers[sources[kind]]
            values = layer.values if not layer.value_dim else layer.keys[..., :layer.value_dim]
            self.shared[kind] = (layer.keys, values)
            window = text.sliding_window if kind == "sliding_attention" else None
            if layer.is_ring and (window is None or layer.keys.shape[2] < window + k + 1):
                # (a ring of window + C - 1 slots; C = max_step_tokens >= k + 2 keeps the last W + 1
                # committed positions through a round that writes k + 1 and rolls back k)
                raise ValueError(f"speculative_generate: speculate_k={k} is too large for model's ring-buffer "
                                 f"layer {sources[kind]} ({layer.keys.shape[2]} slots) to keep what the assistant "
                                 "reads")
            self.windows[kind] = window
        self.step = assistant_step_function(assistant, compile)
        # compiled, a round's drafts are one call
        self.drafts = (compiled_function(assistant, _assistant_drafts, "assistant_drafts", family_model=assistant.model)
                       if compile else None)
        self.embed = model.get_input_embeddings()
        self.hidden = None  # (prefill sets it)

    def masks(self, positions: torch.Tensor) -> dict:
        """Per layer type: [B, 1, 1, S] bool, the slots holding positions the assistant's query at
        ``positions`` [B] reads (those before it, the last W + 1 in a sliding-window layer)."""
        out = {}
        last = positions[:, None] - 1
        for kind, (keys, _) in self.shared.items():
            slots = torch.arange(keys.shape[2], device=keys.device)
            held = last - torch.remainder(last - slots[None, :], keys.shape[2])  # the position in each slot
            window = self.windows[kind]
            out[kind] = ((held >= 0) if window is None else (held >= (last - window).clamp(min=0)))[:, None, None]
        return out

    def prefill(self, prompt: common.Prompt, target_hidden: torch.Tensor | None = None) -> None:
        """The target's hidden state at each row's last prompt token."""
        self.hidden = common.at_columns(target_hidden, common.last_columns(prompt.attention_mask))

    def propose(self, rounds, last, active, history) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> draft tokens [B, k], and their distributions [B, k, V] (None when greedy)."""
        positions = self.cache.seq_lengths.clone()  # (last's position: the target has not taken it in)
        masks = self.masks(positions)
        # (a copy of last: compiled rounds keep it in a buffer marked static, and a call that took it would
        # compile the step with its tokens static, at last's address, which the draft tokens of the later
        # calls do not have: on a GPU CUDA graph trees record the graph again for each new address)
        if self.drafts is not None:
            drafts, distributions = self.drafts(last.clone(), self.hidden, positions, masks, self.shared, self.embed,
                                                rounds.k, rounds.draft_sampling(last), rounds.draft_processing(history))
            # (a CUDA graph's outputs, which the target's next call may write over: as DraftModelProposer's)
            return drafts.clone(), None if distributions is None else distributions.clone()
        logits, state = self.step(last.clone(), self.hidden, positions, masks, self.shared, self.embed)

        def advance(token):
            nonlocal state
            # (a copy of the last call's output, as MtpProposer's)
            next_logits, state = self.step(token, state.clone(), positions, masks, self.shared, self.embed)
            return next_logits

        return rounds.draft(history, logits, advance)

    def commit(self, active, committed, num_accepted, draft_tokens, target_hidden=None) -> None:
        """The round's outcome: the target's hidden state at the last position it kept (last +
        accepted drafts) becomes the rows' next one."""
        self.hidden = torch.where(active[:, None], common.at_columns(target_hidden, num_accepted), self.hidden)
