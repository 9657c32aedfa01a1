"""A hybrid model's recurrent layers (linear attention, Mamba, short convolutions) under a state
rollback: while its StaticKVCache has a checkpoint open (StaticKVCache.checkpoint, modules/
state_history.py), each layer's recurrent block (its "mixer") runs the forward's tokens one column
at a time, through transformers' own single-token path, and leaves its states after every column
in the cache's history. A speculative round can then keep any prefix of its tokens per row.

The mixers run token by token only inside such a round: the prompt and plain decoding take
transformers' path unchanged. A mixer's linear layers that take the mixer's input itself (its
input projections: most of its weights) run once on all T columns, and each column's call gets its
slice; only the rest (the convolution and recurrence, the output projection, which depend on the
column before) runs per column. So a verification forward of T = k + 1 tokens reads a mixer's
output projection T times, its other weights once: the price of exact rollback without per-family
code. Every supported family's blocks have such code (models/recurrent_columns.py): they run all
T columns in one pass, their recurrence alone stepping, and read every weight once; the column loop
here stays for a block of another class or with states of other shapes.
"""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from gptfast_kernels.models.recurrent_columns import column_forward_of
from gptfast_kernels.modules.int8_linear import Int8Linear

# the keywords transformers' mixers take the cache by (5.24: cache; 5.17 to 5.23: cache_params; some
# past_key_values)
CACHE_KEYWORDS = ("cache", "cache_params", "past_key_values")


@functools.cache
def _takes_cache(module_type: type) -> bool:
    """Whether a module class's forward takes a cache (read once per class)."""
    try:
        parameters = inspect.signature(module_type.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in parameters for name in CACHE_KEYWORDS)


def recurrent_mixers(model: nn.Module, family) -> dict[int, nn.Module]:
    """Per decoder layer index, the module that updates that layer's recurrent states: the innermost
    modules taking a cache that are not the family's attention (Qwen3.5's GatedDeltaNet, Bamba's
    Mamba-2 mixer, LFM2's short convolution, Falcon-H1's Mamba beside its attention, ZAYA's
    convolutional q / k / v projection inside its attention ...)."""
    takers = {module for module in model.modules() if module is not model and _takes_cache(type(module))}
    mixers = {}
    for module in takers:
        if type(module).__name__ == family.attention_class or not hasattr(module, "layer_idx"):
            continue
        if any(inner is not module and inner in takers for inner in module.modules()):
            continue  # (a decoder layer: the mixer is inside it)
        mixers[module.layer_idx] = module
    return mixers


def stateful_layers(family, config) -> set[int]:
    """The decoder layers of ``config`` that keep a recurrent state (alone or beside attention)."""
    return {index for index, kind in enumerate(family.layer_kinds(config)) if kind in ("recurrent", "both")}


def install_stepped_mixers(model: nn.Module, family, mixers: dict[int, nn.Module]) -> str | None:
    """In place: the recurrent ``mixers`` of a hybrid ``model`` (``recurrent_mixers``) step token by
    token under an open checkpoint. -> None when every layer with a recurrent state has one
    (speculative decoding can roll it back), else why not."""
    stateful = stateful_layers(family, model.config)
    missing = sorted(stateful - set(mixers))
    if missing:
        return (f"its layers {missing} keep a recurrent state, but no module of theirs that takes the cache besides "
                "the attention updates it (the family's transformers code may have changed)")
    for index in stateful:
        mixer = mixers[index]
        mixer._gptfast_columns = columns = StepColumns()
        mixer._gptfast_column_forward = column_forward_of(mixer)
        mixer.forward = types.MethodType(_stepped_forward, mixer)
        for linear in mixer.modules():
            if isinstance(linear, (nn.Linear, Int8Linear)):
                linear._gptfast_columns = columns
                linear.forward = types.MethodType(_column_linear_forward, linear)
    return None


@dataclass
class StepColumns:
    """A stepped mixer's token columns while it runs them one at a time (else None), shared with its
    linear layers: one whose input is a column itself computes all columns at once, on the first,
    and hands each column its slice (``outputs``: per linear layer)."""
    columns: list | None = None
    whole: object = None  # the mixer's input [B, T, ...], of which ``columns`` are the slices
    outputs: dict = field(default_factory=dict)


def _column_linear_forward(self, x):
    """A stepped mixer's linear layer: on one of the mixer's own input columns, that column of its
    output over all columns (computed once); on anything else, its own forward."""
    steps = self._gptfast_columns
    if steps.columns is not None:
        for t, column in enumerate(steps.columns):
            if x is column:
                whole = steps.outputs.get(id(self))
                if whole is None:
                    whole = steps.outputs[id(self)] = type(self).forward(self, steps.whole)
                return whole[:, t:t + 1]
    return type(self).forward(self, x)


def _column(value, t: int, batch: int, tokens: int):
    """Token column ``t`` of a per-token tensor argument [B, T, ...] (else ``value`` unchanged)."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (batch, tokens):
        return value[:, t:t + 1]
    return value


def _stepped_forward(self, hidden_states, *args, **kwargs):
    """A recurrent mixer's forward: transformers' own, except under an open checkpoint of its
    StaticKVCache, where it runs one token column at a time and records the states after each.
    The padding mask goes: the history gives a padding column's rows their states back."""
    cache = next((kwargs[name] for name in CACHE_KEYWORDS if kwargs.get(name) is not None), None)
    if cache is None:
        cache = next((arg for arg in args if hasattr(arg, "state_history")), None)
    history = getattr(cache, "state_history", None)
    if history is None or not history.is_open:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    if self._gptfast_column_forward is not None:
        output = self._gptfast_column_forward(self, hidden_states, history)
        if output is not None:
            return output
    B, T = hidden_states.shape[:2]
    if "attention_mask" in kwargs:
        kwargs["attention_mask"] = None
    steps = self._gptfast_columns
    steps.columns, steps.whole, steps.outputs = [hidden_states[:, t:t + 1] for t in range(T)], hidden_states, {}
    outputs = []
    try:
        for t in range(T):
            before = history.states_of(self.layer_idx)
            outputs.append(type(self).forward(self, steps.columns[t], *(_column(a, t, B, T) for a in args),
                                              **{name: _column(value, t, B, T) for name, value in kwargs.items()}))
            history.record(self.layer_idx, t, before)
    finally:
        steps.columns, steps.whole, steps.outputs = None, None, {}
    if isinstance(outputs[0], tuple):  # (ZAYA's convolutional projection: query, key, value per token)
        return tuple(_joined([out[i] for out in outputs], B) for i in range(len(outputs[0])))
    return _joined(outputs, B)


def _joined(columns: list, batch: int):
    """The per-column outputs of a stepped mixer as one output: per-token tensors [B, 1, ...]
    joined along the tokens; anything else as the last column gave it."""
    first = columns[0]
    if isinstance(first, torch.Tensor) and first.dim() >= 2 and first.shape[:2] == (batch, 1):
        return torch.cat(columns, dim=1)
    return columns[-1]
