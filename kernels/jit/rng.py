"""Counter-based random numbers: a stateless 32-bit hash of (seed, sequence, node, stream, counter).

Only unsigned 32-bit xor, logical shift, wrapping add and multiply are used, so the torch mirror
in `kernels/rng.py` (int64 arithmetic masked to 32 bits) reproduces every bit. Nothing is
stateful, so a kernel drawing from it can be captured in a CUDA graph and replayed.
"""

import triton
import triton.language as tl


@triton.jit
def mix32(x):
    """lowbias32 (C. Wellons' hash prospector): a bijection on uint32 with full avalanche."""
    x ^= x >> 16
    x *= 0x21F0AAAD
    x ^= x >> 15
    x *= 0x735A2D97
    x ^= x >> 15
    return x


@triton.jit
def stream_key(seed, sequence, node, stream):
    """uint32 key of one random stream: `seed` int64, `sequence`/`node`/`stream` small integers
    (node < 2**16, stream < 2**15); any shapes that broadcast."""
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = mix32(seed_lo ^ 0x5BD1E995)
    key = mix32(key ^ seed_hi)
    key = mix32(key ^ sequence.to(tl.uint32))
    return mix32(key ^ (node + stream * 65536).to(tl.uint32))


@triton.jit
def uniform(key, counter):
    """fp32 uniform in (0, 1) for element `counter` (int, < 2**32) of stream `key` (uint32).

    Two rounds keep streams apart: keys that differ only in bits the counter also flips would
    otherwise share values. 23 bits make `(k + 0.5) * 2**-23` exact, never 0 and never 1.
    """
    bits = mix32(mix32(key ^ counter.to(tl.uint32)) ^ key)
    return ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07


@triton.jit
def gumbel(key, counter):
    """Standard Gumbel noise, -log(-log(u)), from the same stream element as `uniform`."""
    return -tl.log(-tl.log(uniform(key, counter)))
