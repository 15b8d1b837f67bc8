"""Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next): the `linear` attention kind.

Per row t of a sequence, with the projections of its input x_t:
    c_t   = silu(causal_conv1d(qkv, kernel K))      # depthwise, over the last K inputs
    q, k  = l2norm(q_t), l2norm(k_t);  q *= Dk^-1/2 # key heads shared by Hv/Hk value heads
    g_t   = -exp(A_log) * softplus(a_t + dt_bias);  beta_t = sigmoid(b_t)
    S     = S * exp(g_t)                            # S [Hv, Dk, Dv], the recurrent state
    S     = S + k (x) beta_t (v - k^T S)            # the delta rule
    o_t   = q^T S;   out = out_proj(RMSNorm(o_t) * w * silu(z_t))
The layer's cache is a fixed-size state per sequence (`StateSpec`): the conv state (the
last K-1 conv inputs, [C, K-1]) and S. A verify window keeps both after every row, so
that j accepted drafts continue from row j's state (DESIGN 4.9); the engine says which
through `backend.recurrent(layer)`.

This row-by-row torch form is the oracle and the path of verify windows and decode rows;
spans that keep only their last state (prefill chunks) take the chunked form of the same
rule (`delta_rule_chunked`), tested equal to it. Both in fp32, as transformers computes.
On CUDA tensors with a pooled state the layer takes the Triton kernels of
`kernels/gated_delta.py` instead (conv and the fused recurrent rule over every span, long
prefill spans too: correct, slower than chunked), tested equal to the row form.

Tensor names are Qwen3.5's (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`);
a family with fused projections (Qwen3-Next's `in_proj_qkvz`, `in_proj_ba`) overrides
`make_projections` and `project`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from chainspec.kernels import gated_delta
from chainspec.kernels.triton_support import use_kernel
from chainspec.models.cache_spec import StateSpec
from chainspec.models.layers import AttentionBackend
from chainspec.models.recurrent import PooledStates, RecurrentAccess


@dataclass(frozen=True)
class GDNShape:
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads {self.num_v_heads} is not a multiple "
                             f"of linear_num_key_heads {self.num_k_heads}")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


class GatedRMSNorm(nn.Module):
    """RMSNorm over the head dim, scaled by w (not 1 + w), then gated by silu(z)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(dtype) * F.silu(gate.float())).to(dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


CHUNKED_FROM = 8  # spans that keep only their last state, this long or longer: chunked
CHUNK = 16


def chunk_bounds(n: int, chunk: int, cuts: Sequence[int] = ()) -> list[tuple[int, int]]:
    """Rows [lo, hi) of each chunk: `chunk` long, also ending after every row in `cuts`."""
    ends = sorted({*range(chunk, n, chunk), *(c + 1 for c in cuts if 0 <= c < n - 1), n})
    return list(zip([0, *ends[:-1]], ends, strict=True))


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       log_decay: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                       chunk: int = CHUNK, cuts: Sequence[int] = (),
                       states: list[torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over n rows, `chunk` at a time: q, k [n, H, Dk], v [n, H, Dv],
    log_decay, beta [n, H], state [H, Dk, Dv] -> outputs [n, H, Dv] and the final state.
    `cuts`: rows (ascending, before the last) whose state is wanted too: chunks end
    there, and `states` gets the state after each.

    Within a chunk, with G_t the cumulative log decay and S0 the state at its start, the
    rows' updates d_t = beta_t (v_t - S_{t-1}^T k_t) solve a unit lower-triangular system
        d_t + beta_t sum_{i<t} e^(G_t - G_i) (k_t . k_i) d_i = beta_t (v_t - e^(G_t) S0^T k_t)
    and then o_t = e^(G_t) S0^T q_t + sum_{i<=t} e^(G_t - G_i) (q_t . k_i) d_i,
    S = e^(G_last) S0 + sum_i e^(G_last - G_i) k_i d_i^T."""
    outs = []
    wanted = set(cuts)
    for lo, hi in chunk_bounds(q.shape[0], chunk, cuts):
        qc, kc, vc = (x[lo:hi].transpose(0, 1) for x in (q, k, v))  # [H, c, D]
        bc = beta[lo:hi].T[..., None]  # [H, c, 1]
        g = log_decay[lo:hi].T.cumsum(-1)  # [H, c]
        c = g.shape[-1]
        rel = (g[:, :, None] - g[:, None, :]).masked_fill(
            ~torch.ones(c, c, dtype=torch.bool, device=g.device).tril(), float("-inf")).exp()
        lower = (bc * rel * (kc @ kc.transpose(1, 2))).tril(-1)  # [H, c, c]
        eye = torch.eye(c, device=g.device)
        rhs = bc * (vc - g.exp()[..., None] * (kc @ state))  # [H, c, Dv]
        d = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
        outs.append(g.exp()[..., None] * (qc @ state) + (rel * (qc @ kc.transpose(1, 2))) @ d)
        last = (g[:, -1:] - g).exp()[..., None]  # [H, c, 1]
        state = g[:, -1].exp()[:, None, None] * state + (kc * last).transpose(1, 2) @ d
        if hi - 1 in wanted and states is not None:
            states.append(state)
    return torch.cat(outs, dim=1).transpose(0, 1), state


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, shape: GDNShape, layer_id: int) -> None:
        super().__init__()
        self.shape, self.layer_id = shape, layer_id
        s = shape
        self.make_projections(hidden_size)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv_kernel, bias=False,
                                groups=s.conv_dim, padding=s.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads))
        self.norm = GatedRMSNorm(s.v_head_dim, s.eps)
        self.out_proj = nn.Linear(s.value_dim, hidden_size, bias=False)

    @property
    def graph_safe(self) -> bool:
        """A captured step may replay this layer where its kernels run: they read only
        `StateRows`' device tensors; the torch path loops over its host spans."""
        return use_kernel(self.A_log)

    def cache_spec(self) -> StateSpec:
        s = self.shape
        return StateSpec(((s.conv_dim, s.conv_kernel - 1),
                          (s.num_v_heads, s.k_head_dim, s.v_head_dim)))

    def make_projections(self, hidden_size: int) -> None:
        """The input projections `project` reads (Qwen3.5's four; a family overrides)."""
        s = self.shape
        self.in_proj_qkv = nn.Linear(hidden_size, s.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, s.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, s.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, s.num_v_heads, bias=False)

    def project(self, x: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> conv input [T, C], z [T, Hv, Dv], b [T, Hv], a [T, Hv]."""
        z = self.in_proj_z(x).view(x.shape[0], self.shape.num_v_heads, -1)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        del positions  # order is the state's business
        rows = x.shape[0]
        access = backend.recurrent(self.layer_id)
        mixed, z, b, a = self.project(x)
        beta = b.float().sigmoid()  # [T, Hv]
        log_decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        # NOTE: snapshots (prefill spans, never a captured step) take the torch path
        if use_kernel(x) and isinstance(access, PooledStates) and not access.rows.snapshots:
            core = self._core_kernel(access, mixed, log_decay, beta)
        else:
            core = self._core_reference(access, mixed, log_decay, beta)
        out = self.norm(core.to(x.dtype), z)  # [T, Hv, Dv]
        return self.out_proj(out.reshape(rows, -1))

    def _core_reference(self, access: RecurrentAccess, mixed: torch.Tensor,
                        log_decay: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """The torch form (CPU path, oracle): conv + rule per span -> [T, Hv, Dv] fp32."""
        s = self.shape
        core = torch.zeros(mixed.shape[0], s.num_v_heads, s.v_head_dim,
                           device=mixed.device)  # pad rows: 0
        for seq, (lo, hi) in enumerate(access.spans):
            core[lo:hi] = self._span(access, seq, mixed[lo:hi], log_decay[lo:hi], beta[lo:hi])
        return core

    def _core_kernel(self, access: PooledStates, mixed: torch.Tensor,
                     log_decay: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """The Triton kernels over every span at once, no host sync (CUDA graphs)."""
        s, n = self.shape, mixed.shape[0]
        conv_pool, state_pool = access.pool
        conv = gated_delta.conv1d_rows(mixed, self.conv1d.weight[:, 0], conv_pool,
                                       access.rows)  # [T, C] fp32
        q, k, v = conv.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        return gated_delta.delta_rule_rows(
            q.view(n, s.num_k_heads, s.k_head_dim), k.view(n, s.num_k_heads, s.k_head_dim),
            v.view(n, s.num_v_heads, s.v_head_dim), log_decay, beta, state_pool,
            access.rows)

    def _span(self, access: RecurrentAccess, seq: int, mixed: torch.Tensor,
              log_decay: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """One sequence's rows, from its committed state; stores the states it keeps."""
        s, n = self.shape, mixed.shape[0]
        conv_state, state = self._initial(access.load(seq), mixed.device)
        inputs = torch.cat([conv_state.T, mixed.float()])  # [K-1+n, C]
        conv = F.silu(F.conv1d(inputs.T[None], self.conv1d.weight.float(),
                               groups=s.conv_dim)[0].T)  # [n, C]
        q, k, v = conv.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        group = s.num_v_heads // s.num_k_heads
        q = l2norm(q.reshape(n, s.num_k_heads, -1)).repeat_interleave(group, 1)
        k = l2norm(k.reshape(n, s.num_k_heads, -1)).repeat_interleave(group, 1)
        q = q * s.k_head_dim ** -0.5  # [n, Hv, Dk]
        v = v.reshape(n, s.num_v_heads, s.v_head_dim)
        if access.keeps_every_row(seq) or n < CHUNKED_FROM:
            return self._rows(access, seq, inputs, (q, k, v), log_decay, beta, state)
        cuts = [r for r in access.snapshot_rows(seq) if r < n - 1]
        mids: list[torch.Tensor] = []
        out, state = delta_rule_chunked(q, k, v, log_decay, beta, state, cuts=cuts,
                                        states=mids)
        for r, mid in zip(cuts, mids, strict=True):  # snapshots inside the span
            access.store(seq, r, (inputs[r + 1:r + s.conv_kernel].T, mid))
        access.store(seq, n - 1, (inputs[n:].T, state))
        return out

    def _rows(self, access: RecurrentAccess, seq: int, inputs: torch.Tensor,
              qkv: tuple[torch.Tensor, ...], log_decay: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> torch.Tensor:
        """The row form (the oracle), storing the states the sequence keeps."""
        (q, k, v), n = qkv, log_decay.shape[0]
        decay = log_decay.exp()
        keep = access.keeps_every_row(seq)
        snaps = set(access.snapshot_rows(seq))
        out = []
        for t in range(n):
            state = state * decay[t][:, None, None]  # [Hv, Dk, Dv]
            delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
            state = state + k[t][:, :, None] * delta[:, None, :]
            out.append(torch.einsum("hkv,hk->hv", state, q[t]))
            if keep or t == n - 1 or t in snaps:
                access.store(seq, t, (inputs[t + 1:t + self.shape.conv_kernel].T, state))
        return torch.stack(out)  # [n, Hv, Dv]

    def _initial(self, loaded: tuple[torch.Tensor, ...] | None, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv state [C, K-1], S [Hv, Dk, Dv]) in fp32; zeros for a fresh sequence."""
        if loaded is not None:
            return loaded[0].float(), loaded[1].float()
        s = self.shape
        return (torch.zeros(s.conv_dim, s.conv_kernel - 1, device=device),
                torch.zeros(s.num_v_heads, s.k_head_dim, s.v_head_dim, device=device))
