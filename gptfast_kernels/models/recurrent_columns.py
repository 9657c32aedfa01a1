"""A Mamba-2 mixer's verification forward in one pass: all of a speculative round's token columns at
once, with its states after every column, in place of transformers' single-token path run once per
column (models/recurrent.py).

Stepping a Mamba-2 mixer column by column runs its whole single-token path k + 1 times: the output
projection, the convolution and some fifteen small operations on the [B, H, P, N] recurrent state per
column. Here the input and output projections, the convolution, the gated norm and the state's read-out
run once over all T columns; only the recurrence itself (S_t = exp(dt_t A) S_{t-1} + dt_t B_t x_t, two
operations on the state) goes column by column, and it leaves every column's states for the cache's
history (StateHistory.record_columns). A padding column leaves a row's states as they were: its decay
is 1, its input 0 and its convolution window the previous column's.

The arithmetic follows transformers' single-token path (causal_conv1d_update and
selective_state_update in the model's dtypes; the decay in float32), so a round's states and logits
equal the stepped ones within rounding. Mixers: Mamba-2's and its copies in Bamba, Nemotron-H,
GraniteMoE-Hybrid and Zamba2, and Falcon-H1's (its input multipliers and optional norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

# transformers' Mamba-2 mixers (the same forward, copied per family; Falcon-H1's adds multipliers)
MAMBA2_MIXERS = ("Mamba2Mixer", "BambaMixer", "NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer",
                 "Zamba2MambaMixer", "FalconH1Mixer")


def column_forward_of(mixer) -> object | None:
    """The one-pass verification forward for ``mixer``'s class, or None (it steps column by column)."""
    return mamba2_columns_forward if type(mixer).__name__ in MAMBA2_MIXERS else None


def _conv_windows(conv_state: torch.Tensor, inputs: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Each column's convolution window [B, C, T, K]: the last K inputs up to it (its own if real),
    from the state ``conv_state`` [B, C, K] followed by the real columns of ``inputs`` [B, C, T]."""
    B, C, K = conv_state.shape
    T = inputs.shape[-1]
    # the real columns first, in order (a padding column adds nothing to the sequence)
    order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)
    sequence = torch.cat([conv_state, inputs.gather(2, order[:, None, :].expand(B, C, T))], dim=-1)
    seen = real.to(torch.int64).cumsum(dim=1)  # [B, T]: real columns up to each
    index = seen[:, :, None] + torch.arange(K, device=real.device)  # [B, T, K]
    return sequence.gather(2, index.view(B, 1, T * K).expand(B, C, T * K)).view(B, C, T, K)


def mamba2_columns_forward(mixer, hidden_states: torch.Tensor, history) -> torch.Tensor | None:
    """``mixer``'s output for all the forward's columns [B, T, hidden], its states after each recorded
    in ``history``; None when its cache layer does not hold the two states expected (then it steps)."""
    entries = history.slots.get(mixer.layer_idx, [])
    if len(entries) != 2:
        return None
    (conv_dict, conv_key, _), (state_dict, state_key, _) = entries
    conv_state, state = conv_dict[conv_key], state_dict[state_key]
    Bsz, T = hidden_states.shape[:2]
    H, P, N, G = mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, mixer.n_groups
    if conv_state.shape[:2] != (Bsz, mixer.conv_dim) or state.shape != (Bsz, H, P, N):
        return None
    real = history._step_real  # [B, T]
    dtype = hidden_states.dtype

    # 1. the input projection (Falcon-H1: its multipliers around it)
    if hasattr(mixer, "ssm_in_multiplier"):
        hidden_states = hidden_states * mixer.ssm_in_multiplier
    projected = mixer.in_proj(hidden_states)
    if hasattr(mixer, "mup_vector"):
        projected = projected * mixer.mup_vector
    gate, xBC, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, H], dim=-1)

    # 2. the convolution: every column's window, its output, and the conv state it leaves
    weight = mixer.conv1d.weight.squeeze(1)  # [C, K]
    windows = _conv_windows(conv_state.to(weight.dtype), xBC.transpose(1, 2).to(weight.dtype), real)
    C, K = weight.shape
    flat = windows.permute(0, 2, 1, 3).reshape(Bsz * T, C, K)
    convolved = F.conv1d(flat, weight.unsqueeze(1), mixer.conv1d.bias, groups=C).view(Bsz, T, C)
    convolved = ACT2FN[mixer.activation](convolved).to(xBC.dtype)
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
    if gated_norm:
        out = mixer.norm(out, gate)

    history.record_columns(mixer.layer_idx, [windows.permute(2, 0, 1, 3).to(conv_state.dtype),
                                             stored])
    return mixer.out_proj(out.to(dtype))
