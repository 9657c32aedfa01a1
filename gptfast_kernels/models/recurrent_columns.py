"""A recurrent block's verification forward in one pass: all of a speculative round's token columns
at once, with its states after every column, in place of transformers' single-token path run once per
column (models/recurrent.py). Every recurrent block of the supported families has one.

Stepping a block column by column runs its whole single-token path k + 1 times: the output projection,
the convolution and a dozen or more small operations on the recurrent state per column. Here the input
and output projections, the convolution, the norms and gates run once over all T columns; only the
recurrence itself goes column by column (Mamba-2: S_t = exp(dt_t A) S_{t-1} + dt_t B_t x_t; a gated
delta net: decay, the delta rule's write, the read), leaving every column's states for the cache's
history (StateHistory.record_columns). A padding column leaves a row's states as they were: its decay
is 1, its write 0 and its convolution window the previous column's.

The arithmetic follows transformers' single-token path (causal_conv1d_update, then
selective_state_update in the model's dtypes with the decay in float32, or
torch_recurrent_gated_delta_rule in float32), so a round's states and logits equal the stepped ones
within rounding. Blocks: Mamba-2's mixer and its copies in Bamba, Nemotron-H, GraniteMoE-Hybrid and
Zamba2, Falcon-H1's (its input multipliers and optional norm); Qwen3.5's gated delta net and its copies
in Qwen3.5-MoE and LaraMini, Qwen3-Next's (its interleaved input projections), OLMo-Hybrid's (six
projections, beta up to 2), Kimi Linear's delta attention (a decay per key channel); LFM2's short
convolution (LFM2-MoE's, LFM3's); Mamba's mixer (Falcon-Mamba's, Jamba's: norms on dt, B and C;
Zamba's: independent heads); ZAYA1's compressed convolutional attention projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

# transformers' Mamba-2 mixers (the same forward, copied per family; Falcon-H1's adds multipliers)
MAMBA2_MIXERS = ("Mamba2Mixer", "BambaMixer", "NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer",
                 "Zamba2MambaMixer", "FalconH1Mixer")
# transformers' gated delta nets of that form (Qwen3.5's, copied by Qwen3.5-MoE and LaraMini; Qwen3-Next's and
# OLMo-Hybrid's project their input in other layouts)
GATED_DELTA_NETS = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "LaraMiniGatedDeltaNet",
                    "Qwen3NextGatedDeltaNet", "OlmoHybridGatedDeltaNet")
# Mamba's mixer (Falcon-Mamba's and Jamba's add norms on dt, B and C)
MAMBA_MIXERS = ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer")
# LFM2's short convolution (copied by LFM2-MoE and LFM3): a conv state alone
SHORT_CONVOLUTIONS = ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")


def column_forward_of(mixer) -> object | None:
    """The one-pass verification forward for ``mixer``'s class, or None (it steps column by column)."""
    name = type(mixer).__name__
    return (mamba2_columns_forward if name in MAMBA2_MIXERS else
            gated_delta_columns_forward if name in GATED_DELTA_NETS else
            mamba_columns_forward if name in MAMBA_MIXERS else
            zamba_mamba_columns_forward if name == "ZambaMambaMixer" else
            kimi_delta_columns_forward if name == "KimiLinearDeltaAttention" else
            short_conv_columns_forward if name in SHORT_CONVOLUTIONS else
            cca_columns_forward if name == "ZayaCCAProjection" else None)


def _real_first(real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``real`` [B, T] (which columns hold a token): (each row's columns reordered real ones first,
    in order: a padding column adds nothing to a row's sequence of inputs; how many real columns each
    column's row has up to and including it), both [B, T] int64."""
    return torch.argsort((~real).to(torch.int8), dim=1, stable=True), real.to(torch.int64).cumsum(dim=1)


def _conv_windows(conv_state: torch.Tensor, inputs: torch.Tensor, real: torch.Tensor,
                  width: int | None = None) -> torch.Tensor:
    """Each column's convolution window [B, C, T, width]: the last ``width`` inputs up to it (its own if
    real), from the state ``conv_state`` [B, C, K] (the last K inputs) followed by the real columns of
    ``inputs`` [B, C, T]. ``width``: K (the default) or K + 1; a window reaching before the state
    (width K + 1, no real column yet) repeats its first input, so its last K are still the state."""
    B, C, K = conv_state.shape
    T = inputs.shape[-1]
    width = K if width is None else width
    order, seen = _real_first(real)
    sequence = torch.cat([conv_state, inputs.gather(2, order[:, None, :].expand(B, C, T))], dim=-1)
    index = (seen[:, :, None] + torch.arange(K - width, K, device=real.device)).clamp(min=0)  # [B, T, width]
    return sequence.gather(2, index.view(B, 1, T * width).expand(B, C, T * width)).view(B, C, T, width)


def _convolved(conv: torch.nn.Conv1d, activation: str | None, inputs: torch.Tensor, conv_state: torch.Tensor,
               real: torch.Tensor):
    """The depthwise causal convolution ``conv`` of all the forward's columns ``inputs`` [B, T, C] as
    transformers' single-token update runs it per column (in the weight's dtype, then ``activation``):
    (its output [B, T, C], the conv state after each column [T, B, C, K])."""
    weight = conv.weight.squeeze(1)  # [C, K]
    C, K = weight.shape
    B, T = inputs.shape[:2]
    windows = _conv_windows(conv_state.to(weight.dtype), inputs.transpose(1, 2).to(weight.dtype), real)
    flat = windows.permute(0, 2, 1, 3).reshape(B * T, C, K)
    out = F.conv1d(flat, weight.unsqueeze(1), conv.bias, groups=C).view(B, T, C)
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(inputs.dtype), windows.permute(2, 0, 1, 3).to(conv_state.dtype)


def _layer_states(mixer, history, *shapes: tuple[int, ...]) -> list[torch.Tensor] | None:
    """The states of ``mixer``'s cache layer (its conv state, then any recurrent one), or None when they
    are not of ``shapes`` (then it steps)."""
    states = [states_dict[key] for states_dict, key, _ in history.slots.get(mixer.layer_idx, [])]
    if [tuple(state.shape) for state in states] != list(shapes):
        return None
    return states


def _conv_state_shape(conv: torch.nn.Conv1d, batch: int) -> tuple[int, int, int]:
    """The conv state transformers keeps for the depthwise convolution ``conv``: its last K inputs."""
    return batch, conv.in_channels, conv.weight.shape[-1]


def mamba2_columns_forward(mixer, hidden_states: torch.Tensor, history) -> torch.Tensor | None:
    """A Mamba-2 mixer's output for all the forward's columns [B, T, hidden], its states after each
    recorded in ``history``; None when its cache layer holds other states."""
    Bsz, T = hidden_states.shape[:2]
    H, P, N, G = mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, mixer.n_groups
    states = _layer_states(mixer, history, _conv_state_shape(mixer.conv1d, Bsz), (Bsz, H, P, N))
    if states is None:
        return None
    conv_state, state = states
    real = history._step_real  # [B, T]
    dtype = hidden_states.dtype

    # 1. the input projection (Falcon-H1: its multipliers around it)
    if hasattr(mixer, "ssm_in_multiplier"):
        hidden_states = hidden_states * mixer.ssm_in_multiplier
    projected = mixer.in_proj(hidden_states)
    if hasattr(mixer, "mup_vector"):
        projected = projected * mixer.mup_vector
    gate, xBC, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, H], dim=-1)

    # 2. the convolution
    convolved, conv_after = _convolved(mixer.conv1d, mixer.activation, xBC, conv_state, real)
    x, Bmat, Cmat = convolved.split([mixer.intermediate_size, G * N, G * N], dim=-1)

    # 3. the recurrence: S_t = exp(dt_t A) S_{t-1} + dt_t B_t x_t per head, identity at padding
    x = x.view(Bsz, T, H, P)
    Bmat = Bmat.view(Bsz, T, G, 1, N).expand(Bsz, T, G, H // G, N).reshape(Bsz, T, H, N)
    Cmat = Cmat.view(Bsz, T, G, 1, N).expand(Bsz, T, G, H // G, N).reshape(Bsz, T, H, N)
    dt = F.softplus(dt + mixer.dt_bias.to(dt.dtype))  # [B, T, H]
    dt = torch.where(real[:, :, None], dt, 0)  # (a padding column: decay exp(0) = 1, input 0)
    decay = torch.exp(dt.float() * -torch.exp(mixer.A_log.float()))
    stored = state.new_empty((T, *state.shape))
    reads = []
    current = state
    for t in range(T):
        added = (dt[:, t, :, None, None] * Bmat[:, t, :, None, :]) * x[:, t, :, :, None]  # [B, H, P, N]
        new = current * decay[:, t, :, None, None] + added
        stored[t] = new
        current = stored[t]
        reads.append(torch.einsum("bhpn,bhn->bhp", new.to(Cmat.dtype), Cmat[:, t]))

    # 4. the read-out, the skip, the gate or gated norm, the output projection
    out = torch.stack(reads, dim=1)  # [B, T, H, P]
    out = (out + x * mixer.D[:, None]).to(out.dtype)
    gated_norm = getattr(mixer, "mamba_rms_norm", True)
    if not gated_norm:  # (Falcon-H1 without its norm: the gate multiplies the read-out)
        out = out * F.silu(gate.view(Bsz, T, H, P))
    out = out.to(dtype).view(Bsz, T, H * P)
    if gated_norm:  # (reshaped: Falcon-H1's norm drops the token axis of a single column before 5.24)
        out = mixer.norm(out, gate).reshape(Bsz, T, H * P)

    history.record_columns(mixer.layer_idx, [conv_after, stored])
    return mixer.out_proj(out.to(dtype))


def _delta_rule(query, key, value, decay, beta, state: torch.Tensor):
    """The delta rule over all columns, as transformers' recurrent path runs it per token in float32:
    per column the state [B, H, Dk, Dv] decays (``decay`` [B, T, H, 1] per head, or [B, T, H, Dk] per
    key channel: already exponentiated), the key's value is rewritten with strength ``beta`` [B, T, H],
    and the query reads it. -> (the reads [B, T, H, Dv], the states after each column [T, B, H, Dk, Dv]
    in ``state``'s dtype, each column starting from the stored one)."""
    stored = state.new_empty((query.shape[1], *state.shape))
    reads = []
    current = state.float()
    for t in range(query.shape[1]):
        current = current * decay[:, t, :, :, None]
        remembered = (current * key[:, t, :, :, None]).sum(dim=-2)  # [B, H, Dv]
        delta = (value[:, t] - remembered) * beta[:, t, :, None]
        current = current + key[:, t, :, :, None] * delta[:, :, None, :]
        reads.append((current * query[:, t, :, :, None]).sum(dim=-2))
        stored[t] = current
        current = stored[t].float()
    return torch.stack(reads, dim=1), stored


def gated_delta_columns_forward(mixer, hidden_states: torch.Tensor, history) -> torch.Tensor | None:
    """A gated delta net's (Qwen3.5's, Qwen3-Next's, LaraMini's, OLMo-Hybrid's) output for all the
    forward's columns [B, T, hidden], its states after each recorded in ``history``, following
    transformers' single-token path (torch_recurrent_gated_delta_rule in float32); None when its cache
    layer holds other states."""
    Bsz, T = hidden_states.shape[:2]
    Hk, Hv, Dk, Dv = mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
    states = _layer_states(mixer, history, _conv_state_shape(mixer.conv1d, Bsz), (Bsz, Hv, Dk, Dv))
    if states is None:
        return None
    conv_state, state = states
    real = history._step_real  # [B, T]

    # 1. the input projections, called in transformers' order (with int8 they are parts of one matmul)
    if hasattr(mixer, "in_proj_qkvz"):  # (Qwen3-Next: two projections, its heads' parts interleaved)
        qkvz, ba = mixer.in_proj_qkvz(hidden_states), mixer.in_proj_ba(hidden_states)
        query, key, value, z, b, a = mixer.fix_query_key_value_ordering(qkvz, ba)
        mixed = torch.cat([part.reshape(Bsz, T, -1) for part in (query, key, value)], dim=-1)
    elif hasattr(mixer, "in_proj_qkv"):
        mixed = mixer.in_proj_qkv(hidden_states)
        z = mixer.in_proj_z(hidden_states)
        b, a = mixer.in_proj_b(hidden_states), mixer.in_proj_a(hidden_states)
    else:  # (OLMo-Hybrid: six projections, its output gate g_proj)
        mixed = torch.cat([mixer.q_proj(hidden_states), mixer.k_proj(hidden_states), mixer.v_proj(hidden_states)],
                          dim=-1)
        b, a = mixer.b_proj(hidden_states), mixer.a_proj(hidden_states)
        z = mixer.g_proj(hidden_states)
    z = z.reshape(Bsz, T, Hv, Dv)

    # 2. the convolution, then queries, keys and values per head in float32 (keys and queries shared by
    # Hv / Hk value heads, unit length, queries over sqrt(Dk))
    convolved, conv_after = _convolved(mixer.conv1d, mixer.activation, mixed, conv_state, real)
    query, key, value = convolved.split([mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    out_dtype = query.dtype
    query, key = (part.reshape(Bsz, T, Hk, Dk).repeat_interleave(Hv // Hk, dim=2).float() for part in (query, key))
    value = value.reshape(Bsz, T, Hv, Dv).float()
    query = query * torch.rsqrt((query * query).sum(dim=-1, keepdim=True) + 1e-6)
    key = key * torch.rsqrt((key * key).sum(dim=-1, keepdim=True) + 1e-6)
    query = query / (Dk ** 0.5)

    # 3. the recurrence per column; a padding column decays by exp(0) = 1 and writes with strength 0
    beta = b.sigmoid()
    if getattr(mixer, "allow_neg_eigval", False):  # (OLMo-Hybrid's option: beta in [0, 2])
        beta = beta * 2.0
    beta = torch.where(real[:, :, None], beta, 0).float()  # [B, T, Hv]
    g = -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)
    decay = torch.where(real[:, :, None], g, 0).exp()[..., None]  # [B, T, Hv, 1]
    out, stored = _delta_rule(query, key, value, decay, beta, state)
    out = out.to(out_dtype)  # [B, T, Hv, Dv]

    # 4. the gated norm per head, the output projection (OLMo-Hybrid's: o_norm, o_proj)
    norm, projection = (mixer.o_norm, mixer.o_proj) if hasattr(mixer, "o_norm") else (mixer.norm, mixer.out_proj)
    out = norm(out.reshape(-1, Dv), z.reshape(-1, Dv)).reshape(Bsz, T, -1)
    history.record_columns(mixer.layer_idx, [conv_after, stored])
    return projection(out)


def short_conv_columns_forward(mixer, hidden_states: torch.Tensor, history) -> torch.Tensor | None:
    """An LFM2 short convolution's (LFM2's, LFM2-MoE's, LFM3's) output for all the forward's columns
    [B, T, hidden], its conv state after each recorded in ``history``: B * x through the causal
    convolution, times C; None when its cache layer holds other states."""
    Bsz, T = hidden_states.shape[:2]
    states = _layer_states(mixer, history, _conv_state_shape(mixer.conv, Bsz))
    if states is None:
        return None
    gate_in, gate_out, x = mixer.in_proj(hidden_states).chunk(3, dim=-1)
    convolved, conv_after = _convolved(mixer.conv, None, gate_in * x, states[0], history._step_real)
    history.record_columns(mixer.layer_idx, [conv_after])
    return mixer.out_proj((gate_out * convolved).contiguous())


def _selective_scan_columns(x, dt, dt_bias, A, Bmat, Cmat, D, gate, state: torch.Tensor, real: torch.Tensor):
    """Mamba's selective scan over all columns, as transformers' mamba_selective_state_update runs it per
    token: per head h and column t, S = exp(dt A) S + dt B x in float32, read out by C, plus D x, times
    silu(gate). x, dt (before its bias and softplus), gate [B, T, H, Dh]; A [H, Dh, N]; B, C [B, T, H,
    N]; D [H, Dh]; ``state`` [B, H, Dh, N]. -> (the output [B, T, H, Dh] in x's dtype, the states after
    each column [T, B, H, Dh, N] in ``state``'s dtype)."""
    if dt_bias is not None:
        dt = dt + dt_bias.float().to(dt.dtype)
    dt = torch.where(real[:, :, None, None], F.softplus(dt), 0)  # (a padding column: decay exp(0) = 1, input 0)
    decay = torch.exp(dt.float()[..., None] * A)  # [B, T, H, Dh, N]
    added = (dt.float()[..., None] * Bmat.float()[:, :, :, None, :]) * x.float()[..., None]
    stored = state.new_empty((x.shape[1], *state.shape))
    reads = []
    current = state
    for t in range(x.shape[1]):
        new = current.float() * decay[:, t] + added[:, t]
        stored[t] = new
        current = stored[t]
        reads.append(torch.matmul(new.to(Cmat.dtype), Cmat[:, t, :, :, None]).squeeze(-1))
    return ((torch.stack(reads, dim=1) + x * D) * F.silu(gate)).to(x.dtype), stored


def mamba_columns_forward(mixer, hidden_states: torch.Tensor, history) -> torch.Tensor | None:
    """A Mamba mixer's (Mamba's, Falcon-Mamba's, Jamba's) output for all the forward's columns [B, T,
    hidden], its states after each recorded in ``history``, following transformers' single-token path;
    None when its cache layer holds other states."""
    Bsz, T = hidden_states.shape[:2]
    Di, N = mixer.intermediate_size, mixer.ssm_state_size
    states = _layer_states(mixer, history, _conv_state_shape(mixer.conv1d, Bsz), (Bsz, Di, N))
    if states is None:
        return None
    conv_state, state = states

    # the input projection and the convolution
    inputs, gate = mixer.in_proj(hidden_states).chunk(2, dim=-1)
    x, conv_after = _convolved(mixer.conv1d, mixer.activation, inputs, conv_state, history._step_real)  # [B, T, Di]

    # the time steps, B and C (Falcon-Mamba, Jamba: normed), dt through the float dt_proj; one scan "head"
    time_step, Bmat, Cmat = mixer.x_proj(x).split([mixer.time_step_rank, N, N], dim=-1)
    if hasattr(mixer, "dt_layernorm"):
        time_step, Bmat, Cmat = mixer.dt_layernorm(time_step), mixer.b_layernorm(Bmat), mixer.c_layernorm(Cmat)
    dt = (mixer.dt_proj.weight @ time_step.transpose(1, 2)).transpose(1, 2)  # [B, T, Di]
    A = -torch.exp(mixer.A_log.float())
    out, stored = _selective_scan_columns(
        x[:, :, None], dt[:, :, None], mixer.dt_proj.bias, A[None], Bmat[:, :, None], Cmat[:, :, None],
        mixer.D[None], gate[:, :, None], state[:, None], history._step_real)
    history.record_columns(mixer.layer_idx, [conv_after, stored[:, :, 0]])
    return mixer.out_proj(out[:, :, 0].to(hidden_states.dtype))


def zamba_mamba_columns_forward(mixer, hidden_states: torch.Tensor, history) -> torch.Tensor | None:
    """Zamba's Mamba mixer (independent Mamba heads, each with its own x_proj and dt_proj) for all the
    forward's columns, as mamba_columns_forward."""
    Bsz, T = hidden_states.shape[:2]
    H, Dh, N = mixer.n_mamba_heads, mixer.mamba_head_dim, mixer.ssm_state_size
    states = _layer_states(mixer, history, _conv_state_shape(mixer.conv1d, Bsz), (Bsz, H, Dh, N))
    if states is None:
        return None
    conv_state, state = states

    # the input projection (its features alternate input, gate) and the convolution
    projected = mixer.in_proj(hidden_states).view(Bsz, T, -1, 2)
    inputs, gate = projected[..., 0], projected[..., 1].reshape(Bsz, T, H, Dh)
    x, conv_after = _convolved(mixer.conv1d, mixer.activation, inputs, conv_state, history._step_real)
    x = x.view(Bsz, T, H, Dh)

    # per head: B, C and dt from its own projections
    parameters = torch.einsum("hrd,bthd->bthr", mixer.x_proj_weight, x)
    time_step, Bmat, Cmat = parameters.split([mixer.time_step_rank, N, N], dim=-1)
    dt = torch.einsum("hdr,bthr->bthd", mixer.dt_proj_weight, time_step)
    out, stored = _selective_scan_columns(x, dt, mixer.dt_proj_bias, -torch.exp(mixer.A_log.float()), Bmat, Cmat,
                                          mixer.D, gate, state, history._step_real)
    history.record_columns(mixer.layer_idx, [conv_after, stored])
    return mixer.out_proj(out.reshape(Bsz, T, H * Dh).to(hidden_states.dtype))


def kimi_delta_columns_forward(mixer, hidden_states: torch.Tensor, history) -> torch.Tensor | None:
    """Kimi delta attention's output for all the forward's columns [B, T, hidden], its states after each
    recorded in ``history``: a gated delta net whose decay is per key channel (its low-rank forget gate),
    following transformers' recurrent_kimi_delta_attention in float32; None when its cache layer holds
    other states."""
    Bsz, T = hidden_states.shape[:2]
    H, D = mixer.num_heads, mixer.head_dim
    states = _layer_states(mixer, history, _conv_state_shape(mixer.conv1d, Bsz), (Bsz, H, D, D))
    if states is None:
        return None
    conv_state, state = states
    real = history._step_real

    # the projections in transformers' order (with int8, q / k / v / b / g_a are parts of one matmul)
    mixed = torch.cat([mixer.q_proj(hidden_states), mixer.k_proj(hidden_states), mixer.v_proj(hidden_states)],
                      dim=-1)
    convolved, conv_after = _convolved(mixer.conv1d, mixer.activation, mixed, conv_state, real)
    query, key, value = (part.reshape(Bsz, T, H, D) for part in convolved.split([mixer.qkv_dim] * 3, dim=-1))
    g = mixer.forget_gate(hidden_states)  # [B, T, H, D], float32
    beta = torch.sigmoid(mixer.b_proj(hidden_states))
    gate = mixer.g_b_proj(mixer.g_a_proj(hidden_states)).view(Bsz, T, H, D)

    # queries and keys unit length (as x / sqrt(|x|^2 + eps)), queries over sqrt(D); the delta rule
    out_dtype = query.dtype
    query, key, value = query.float(), key.float(), value.float()
    query = query / torch.sqrt((query * query).sum(dim=-1, keepdim=True) + 1e-6)
    key = key / torch.sqrt((key * key).sum(dim=-1, keepdim=True) + 1e-6)
    query = query * (1 / D ** 0.5)
    beta = torch.where(real[:, :, None], beta, 0).float()
    decay = torch.where(real[:, :, None, None], g, 0).exp()
    out, stored = _delta_rule(query, key, value, decay, beta, state)

    history.record_columns(mixer.layer_idx, [conv_after, stored])
    return mixer.o_proj(mixer.o_norm(out.to(out_dtype), gate).reshape(Bsz, T, -1))


def cca_columns_forward(mixer, hidden_states: torch.Tensor, history):
    """ZAYA1's compressed convolutional attention projection for all the forward's columns: (queries,
    keys, values) [B, T, heads, D] as transformers computes them, its states after each column recorded
    in ``history``: the conv state (the last (K0 - 1) + (K1 - 1) query / key inputs, convolved depthwise
    over K0 then per head over K1) and the delayed value projection of the last real token, which the
    next token's values take half of. (Its conv_mask zeroes padding tokens' inputs; every real column
    of a round has it 1, and a padding column changes no state.) None when the cache layer holds other
    states."""
    Bsz, T = hidden_states.shape[:2]
    D, groups = mixer.head_dim, mixer.num_key_value_groups
    channels, width = mixer.conv_qk_depthwise.in_channels, mixer.conv_kernel_size
    half = mixer.v_proj_delayed.out_features
    states = _layer_states(mixer, history, (Bsz, channels, width), (Bsz, half))
    if states is None:
        return None
    conv_state, delayed_state = states
    real = history._step_real

    # the projections in transformers' order (with int8 they are parts of one matmul), the residual paths
    queries, keys = mixer.q_proj(hidden_states), mixer.k_proj(hidden_states)
    current, delayed = mixer.v_proj_current(hidden_states), mixer.v_proj_delayed(hidden_states)
    query_residual = queries.view(Bsz, T, -1, D)
    query_residual = (query_residual + keys.view(Bsz, T, -1, D).repeat_interleave(groups, dim=2)) * 0.5
    key_residual = query_residual.view(Bsz, T, -1, groups, D).mean(dim=-2)

    # the two convolutions over each column's window of its own input and the state before it
    windows = _conv_windows(conv_state, torch.cat([queries, keys], dim=-1).transpose(1, 2), real, width + 1)
    flat = windows.permute(0, 2, 1, 3).reshape(Bsz * T, channels, width + 1)
    mixed = mixer.conv_qk_grouped(mixer.conv_qk_depthwise(flat)).view(Bsz, T, channels)
    query = mixed[..., :queries.shape[-1]].view(Bsz, T, -1, D) + query_residual
    key = mixed[..., queries.shape[-1]:].view(Bsz, T, -1, D) + key_residual

    # values: half the current token's, half the last real token's before it (the state, at first)
    order, seen = _real_first(real)
    sequence = torch.cat([delayed_state[:, None].to(delayed.dtype),
                          delayed.gather(1, order[:, :, None].expand(Bsz, T, half))], dim=1)  # [B, 1 + T, half]
    before = sequence.gather(1, (seen - real.to(torch.int64))[:, :, None].expand(Bsz, T, half))
    after = sequence.gather(1, seen[:, :, None].expand(Bsz, T, half))
    value = torch.cat([current, before], dim=-1).view(Bsz, T, -1, D)

    history.record_columns(mixer.layer_idx, [windows[..., 1:].permute(2, 0, 1, 3).to(conv_state.dtype),
                                             after.transpose(0, 1).to(delayed_state.dtype)])
    return query, key, value
