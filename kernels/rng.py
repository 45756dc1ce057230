"""Counter-based random numbers in torch: `jit/rng.py`'s stateless 32-bit hash of (seed,
sequence, node, stream, counter) on int64 tensors masked to 32 bits, bit for bit (products stay
below 2**63). The references and the fused-torch ops draw from it, the Triton kernels from
`jit/rng.py`, so every backend draws the same numbers (`reference/verify.py` states how verify
uses them).
"""

import torch

# verify's streams: a node's draw from its target distribution, a chain node's acceptance test
# (the draft model's samples use stream 2, the block drafters' 3).
STREAM_SAMPLE = 0
STREAM_ACCEPT = 1
_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """`jit/rng.py:mix32` on int64 tensors holding uint32 values (products stay below 2**63)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def stream_key(seed, sequence, node, stream: int) -> torch.Tensor:
    """`jit/rng.py:stream_key`: int64 tensors (broadcasting) to an int64 tensor of uint32 keys."""
    key = _mix32((seed & _MASK32) ^ 0x5BD1E995)
    key = _mix32(key ^ ((seed >> 32) & _MASK32))
    key = _mix32(key ^ sequence)
    return _mix32(key ^ (node + stream * 65536))


def uniform(key: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """`jit/rng.py:uniform`: fp32 in (0, 1), bit for bit."""
    bits = _mix32(_mix32(key ^ counter) ^ key)
    return ((bits >> 9).to(torch.float32) + 0.5) * 2.0**-23


def node_keys(seed: torch.Tensor, sequence: torch.Tensor, nodes: torch.Tensor, stream: int):
    """int64 `[B, K]` uint32 keys of stream `stream` at `nodes` (int64 `[1 or B, K]`): from
    (seed `[B]`, sequence `[B]`, node), or with per-node seeds (`seed` int64 `[B, N]`) from the
    node's own seed alone (`jit/verify.py:_node_key`); nodes past N take the last seed."""
    if seed.dim() == 2:
        index = nodes.clamp(max=seed.shape[1] - 1).expand(seed.shape[0], -1)
        return stream_key(seed.gather(1, index), 0, 0, stream)
    return stream_key(seed[:, None], sequence[:, None], nodes, stream)


def gumbel(key: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(uniform(key, counter)))
