"""Triton kernels of two-phase Block AttnRes (arXiv:2603.15031, Algorithm 1, softmax router of Eq. 1-4 over the
sources of Eq. 6), forward and backward, one program per token (or per tile of a token's `S x D`, `TILE`):

- **phase 1** (a block starts): the scores of the block's `S` pseudo-queries against the `n` completed sources,
  their log-sum-exp and the weighted sums, in one read of each source with an online softmax (running max and
  normaliser per query); backward reads each source twice (the softmax's `sum_i p_i dp_i`, then the scores'
  gradients), and a second kernel makes the sources' gradients from the scores'.
- **the merge** (phase 2, every sub-layer of the block): the partial sum's logit and key norm, its softmax share
  against the completed sources' log-sum-exp, and `share mixed + (1 - share) partial`; backward in one pass.
  Without gradients it can first add the last sub-layer's output to the partial sum (the residual add, fused).

The launchers take and return torch tensors; the autograd Functions that call them, and the dispatch, are in
`attnres_triton.py`. Arithmetic is fp32 whatever the stream dtype (values are read in their dtype and cast). Triton
runs on CUDA, and on CPU tensors under `TRITON_INTERPRET=1` (how `make test` checks these kernels).

Imported only when `attnres_implementation="triton"` is used (`attnres_triton._kernels`); travels with checkpoints
as remote code (a relative import of `attnres_triton.py`): imports only torch and Triton.
"""

import contextlib

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError as error:  # (in a `try`: transformers' remote-code loader does not require what is in one)
    raise ImportError('attnres_implementation="triton" needs Triton: pip install "attnres-hf[triton]"') from error



@triton.jit
def _phase1_forward_kernel(values, inv_rms, queries, logits, lse, mixed, n, rows, dim, S, tiles,
                           HAS_NORM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    program = tl.program_id(0).to(tl.int64)  # (a token's `tiles` programs, one per `BLOCK_S` queries, are adjacent)
    row, tile = program // tiles, program % tiles
    offs_s, offs_d = tile * BLOCK_S + tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    mask_s, mask_d = offs_s < S, offs_d < dim
    mask_sd = mask_s[:, None] & mask_d[None, :]
    q = tl.load(queries + offs_s[:, None] * dim + offs_d[None, :], mask=mask_sd, other=0.0)
    running_max = tl.full([BLOCK_S], float("-inf"), tl.float32)
    normaliser = tl.zeros([BLOCK_S], dtype=tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    for i in range(n):
        v = tl.load(values + (i * rows + row) * dim + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        z = tl.sum(q * v[None, :], axis=1)  # (S,): w_s . v_i
        if HAS_NORM:
            z = z * tl.load(inv_rms + row * n + i)
        tl.store(logits + (row * S + offs_s) * n + i, z, mask=mask_s)
        new_max = tl.maximum(running_max, z)
        rescale, weight = tl.exp(running_max - new_max), tl.exp(z - new_max)
        normaliser = normaliser * rescale + weight
        acc = acc * rescale[:, None] + weight[:, None] * v[None, :]
        running_max = new_max
    out = acc / normaliser[:, None]
    tl.store(mixed + (row * S + offs_s[:, None]) * dim + offs_d[None, :], out.to(mixed.dtype.element_ty),
             mask=mask_sd)
    tl.store(lse + row * S + offs_s, running_max + tl.log(normaliser), mask=mask_s)


@triton.jit
def _phase1_backward_kernel(values, inv_rms, queries, probs, grad_mixed, grad_lse, grad_probs, grad_inv,
                            grad_scores, n, rows, dim, S, tiles,
                            HAS_NORM: tl.constexpr, HAS_GRAD_MIXED: tl.constexpr, HAS_GRAD_LSE: tl.constexpr,
                            HAS_GRAD_PROBS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    program = tl.program_id(0).to(tl.int64)
    row, tile = program // tiles, program % tiles
    offs_s, offs_d = tile * BLOCK_S + tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    mask_s, mask_d = offs_s < S, offs_d < dim
    mask_sd = mask_s[:, None] & mask_d[None, :]
    q = tl.load(queries + offs_s[:, None] * dim + offs_d[None, :], mask=mask_sd, other=0.0)
    gm = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    if HAS_GRAD_MIXED:
        gm = tl.load(grad_mixed + (row * S + offs_s[:, None]) * dim + offs_d[None, :], mask=mask_sd,
                     other=0.0).to(tl.float32)
    # pass 1: delta_s = sum_i p_si dL/dp_si, dL/dp_si = gm_s . v_i (+ the depth weights' own gradient)
    delta = tl.zeros([BLOCK_S], dtype=tl.float32)
    for i in range(n):
        p = tl.load(probs + (row * S + offs_s) * n + i, mask=mask_s, other=0.0)
        dp = tl.zeros([BLOCK_S], dtype=tl.float32)
        if HAS_GRAD_MIXED:
            v = tl.load(values + (i * rows + row) * dim + offs_d, mask=mask_d, other=0.0).to(tl.float32)
            dp = tl.sum(gm * v[None, :], axis=1)
        if HAS_GRAD_PROBS:
            dp += tl.load(grad_probs + (row * S + offs_s) * n + i, mask=mask_s, other=0.0)
        delta += p * dp
    gl = tl.zeros([BLOCK_S], dtype=tl.float32)
    if HAS_GRAD_LSE:
        gl = tl.load(grad_lse + row * S + offs_s, mask=mask_s, other=0.0)
    # pass 2: dL/dz_si = p_si (dp_si - delta_s + gl_s); z_si = r_i (w_s . v_i)
    for i in range(n):
        v = tl.load(values + (i * rows + row) * dim + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        p = tl.load(probs + (row * S + offs_s) * n + i, mask=mask_s, other=0.0)
        dp = tl.zeros([BLOCK_S], dtype=tl.float32)
        if HAS_GRAD_MIXED:
            dp = tl.sum(gm * v[None, :], axis=1)
        if HAS_GRAD_PROBS:
            dp += tl.load(grad_probs + (row * S + offs_s) * n + i, mask=mask_s, other=0.0)
        dz = p * (dp - delta + gl)
        if HAS_NORM:
            r = tl.load(inv_rms + row * n + i)
            dots = tl.sum(q * v[None, :], axis=1)
            tl.store(grad_inv + (row * tiles + tile) * n + i, tl.sum(dz * dots, axis=0))  # this tile's share
            dz = dz * r  # the gradient of the scores w_s . v_i
        tl.store(grad_scores + (row * S + offs_s) * n + i, dz, mask=mask_s)


@triton.jit
def _phase1_values_backward_kernel(queries, probs, grad_mixed, grad_scores, grad_values, n, rows, dim, S, chunks,
                                   HAS_GRAD_MIXED: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_S: tl.constexpr,
                                   BLOCK_D: tl.constexpr):
    # the sources' gradients, one program per token and `BLOCK_D` hidden units (all the queries): dL/dv_i =
    # sum_s dL/dscore_si w_s (+ p_si dL/dmixed_s), from the scores' gradients `_phase1_backward_kernel` wrote
    program = tl.program_id(0).to(tl.int64)
    row, chunk = program // chunks, program % chunks
    offs_s, offs_d = tl.arange(0, BLOCK_S), chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_s, mask_d = offs_s < S, offs_d < dim
    mask_sd = mask_s[:, None] & mask_d[None, :]
    q = tl.load(queries + offs_s[:, None] * dim + offs_d[None, :], mask=mask_sd, other=0.0)
    gm = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    if HAS_GRAD_MIXED:
        gm = tl.load(grad_mixed + (row * S + offs_s[:, None]) * dim + offs_d[None, :], mask=mask_sd,
                     other=0.0).to(tl.float32)
    for i in range(n):
        dz = tl.load(grad_scores + (row * S + offs_s) * n + i, mask=mask_s, other=0.0)
        dv = tl.sum(dz[:, None] * q, axis=0)
        if HAS_GRAD_MIXED:
            p = tl.load(probs + (row * S + offs_s) * n + i, mask=mask_s, other=0.0)
            dv += tl.sum(p[:, None] * gm, axis=0)
        target = grad_values + (i * rows + row) * dim + offs_d
        if ACCUMULATE:
            dv += tl.load(target, mask=mask_d, other=0.0).to(tl.float32)
        tl.store(target, dv.to(grad_values.dtype.element_ty), mask=mask_d)


@triton.jit
def _merge_forward_kernel(partial, output, summed, mixed, mixed_stride, query, lse, lse_stride, hidden, logit, eps,
                          dim, HAS_NORM: tl.constexpr, HAS_OUTPUT: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    v = tl.load(partial + row * dim + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_OUTPUT:  # the partial sum `partial + output`, rounded to its dtype (to nearest, as torch's add; Triton's
        # interpreter truncates bf16), then read
        v = (v + tl.load(output + row * dim + offs_d, mask=mask_d, other=0.0).to(tl.float32)).to(
            summed.dtype.element_ty)
        tl.store(summed + row * dim + offs_d, v, mask=mask_d)
        v = v.to(tl.float32)
    m = tl.load(mixed + row * mixed_stride + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    q = tl.load(query + offs_d, mask=mask_d, other=0.0)
    p = tl.sum(v * q, axis=0)
    if HAS_NORM:
        p = p / tl.sqrt(tl.sum(v * v, axis=0) / dim + eps)
    # the completed sources' share of the softmax mass and the partial sum's (each its own sigmoid: `1 - share` in
    # fp32 loses the digits of a small share, which backward multiplies the partial sum's gradient by)
    x = tl.load(lse + row * lse_stride) - p
    share, keep = tl.sigmoid(x), tl.sigmoid(-x)
    tl.store(hidden + row * dim + offs_d, (share * m + keep * v).to(hidden.dtype.element_ty), mask=mask_d)
    tl.store(logit + row, p)


@triton.jit
def _merge_backward_kernel(partial, mixed, mixed_stride, query, lse, lse_stride, logit, grad_hidden, grad_logit,
                           grad_partial, grad_mixed, grad_lse, coefficient, eps, dim,
                           HAS_NORM: tl.constexpr, HAS_GRAD_HIDDEN: tl.constexpr, HAS_GRAD_LOGIT: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    v = tl.load(partial + row * dim + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    q = tl.load(query + offs_d, mask=mask_d, other=0.0)
    p = tl.load(logit + row)
    x = tl.load(lse + row * lse_stride) - p
    share, keep = tl.sigmoid(x), tl.sigmoid(-x)
    grad_p = tl.zeros([1], dtype=tl.float32).sum(axis=0)
    if HAS_GRAD_LOGIT:
        grad_p += tl.load(grad_logit + row)
    dv = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_GRAD_HIDDEN:
        g = tl.load(grad_hidden + row * dim + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        m = tl.load(mixed + row * mixed_stride + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        dshare = tl.sum(g * (m - v), axis=0)
        dlse = dshare * share * keep
        grad_p -= dlse
        dv = g * keep
        tl.store(grad_mixed + row * dim + offs_d, (g * share).to(grad_mixed.dtype.element_ty), mask=mask_d)
        tl.store(grad_lse + row, dlse)
    if HAS_NORM:  # p = r (v . q), r = (mean(v^2) + eps)^(-1/2)
        r = 1 / tl.sqrt(tl.sum(v * v, axis=0) / dim + eps)
        c = grad_p * r
        dv += c * q - (c * p * r / dim) * v
    else:
        c = grad_p
        dv += c * q
    tl.store(coefficient + row, c)
    tl.store(grad_partial + row * dim + offs_d, dv.to(grad_partial.dtype.element_ty), mask=mask_d)


INTERPRETED = isinstance(_merge_forward_kernel, InterpretedFunction)
"""Whether these kernels run in Triton's interpreter, on any device's tensors (CPU included): `TRITON_INTERPRET=1`
when this module was imported."""
if INTERPRETED and not isinstance(tl.sigmoid, InterpretedFunction):
    # (Triton's own `tl.sum`, `tl.sigmoid`, ... are kernels too, defined when Triton is first imported)
    raise ImportError("TRITON_INTERPRET=1 was set after Triton was imported: set it before the first import of "
                      "Triton (or of a library that imports it)")


def _check_contiguous(**tensors) -> None:
    """Raise `ValueError` naming a tensor the kernels index as contiguous that is not (`None`: not given); these are
    written in place or are views of the source buffer, which a copy would not be."""
    for name, tensor in tensors.items():
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous (shape {tuple(tensor.shape)}, strides {tensor.stride()})")


def _device_of(tensor: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensors' (a model on `cuda:1`, `device_map`)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


TILE = 8192
"""The most elements of one fp32 `(queries, hidden units)` tile a phase-1 program holds in registers (it holds two:
the queries and the weighted sums, or the queries and the sums' gradients), 32 a thread at 8 warps. A token's larger
`S x D` is split across programs: by queries in phase 1 (each program reads all its token's sources; the other tiles'
reads come from the L2 cache, their programs being adjacent) and by hidden units in the sources' gradients. One whole
`S x D` a program spilled to local memory from `D = 2048, S = 8` on (`tests/test_triton_compile.py` compiles every
kernel for sm_80 and sm_90 at the models' shapes and checks that none spills)."""


def _warps(elements: int, per_thread: int) -> int:
    """Warps for a program whose largest tensors have `elements` each: `per_thread` of them a thread, 4 to 8 warps."""
    return min(max(elements // (32 * per_thread), 4), 8)


def _phase1_tiles(dim: int, S: int) -> tuple[int, int, int, int]:
    """Phase 1's split of a token's `S x D`: `(BLOCK_S, BLOCK_D, programs a token, num_warps)`, the queries split
    into tiles of at most `TILE` elements (all of `D` in each)."""
    block_d = triton.next_power_of_2(dim)
    block_s = min(triton.next_power_of_2(max(S, 1)), max(TILE // block_d, 1))
    return block_s, block_d, triton.cdiv(max(S, 1), block_s), _warps(block_s * block_d, 32)


def _values_tiles(dim: int, S: int) -> tuple[int, int, int, int]:
    """The sources' gradients' split of a token's `S x D`: `(BLOCK_S, BLOCK_D, programs a token, num_warps)`, the
    hidden units split into chunks of at most `TILE` elements (all `S` queries in each)."""
    block_s = triton.next_power_of_2(max(S, 1))
    block_d = min(triton.next_power_of_2(dim), max(TILE // block_s, 1))
    return block_s, block_d, triton.cdiv(dim, block_d), _warps(block_s * block_d, 32)


def _merge_blocks(dim: int) -> tuple[int, int]:
    """The merge's `(BLOCK_D, num_warps)`: one program a token, 16 elements of each `D`-vector a thread."""
    block_d = triton.next_power_of_2(dim)
    return block_d, _warps(block_d, 16)


def phase1_forward(values: torch.Tensor, inv_rms: torch.Tensor | None, queries: torch.Tensor, probs: bool = True):
    """Phase 1 over the completed sources.

    Args:
        values: `(n, B, T, D)` contiguous (the source buffer's first `n` slots), any float dtype.
        inv_rms: `(B, T, n)` fp32 contiguous, each source's `1/RMS` (the key norm), or `None` (no key norm).
        queries: `(S, D)` fp32 contiguous, the block's pseudo-queries with the key-norm weights folded in.
        probs: whether to return the softmax (`False`: `None` in its place, one launch fewer: inference without
            depth weights reads `lse` and `mixed` only).

    Returns:
        `probs (B, T, S, n)` fp32 (the softmax over the sources), `lse (B, T, S)` fp32 and `mixed (B, T, S, D)` in
        the values' dtype (`sum_i probs_i v_i`, accumulated in fp32).
    """
    _check_contiguous(values=values)
    inv_rms, queries = (None if inv_rms is None else inv_rms.contiguous()), queries.contiguous()
    n, batch, seq, dim = values.shape
    S, rows = queries.shape[0], batch * seq
    logits = values.new_empty(batch, seq, S, n, dtype=torch.float32)
    lse = values.new_empty(batch, seq, S, dtype=torch.float32)
    mixed = values.new_empty(batch, seq, S, dim)
    block_s, block_d, tiles, warps = _phase1_tiles(dim, S)
    with _device_of(values):
        _phase1_forward_kernel[(rows * tiles,)](values, inv_rms if inv_rms is not None else lse, queries, logits, lse,
                                                mixed, n, rows, dim, S, tiles, HAS_NORM=inv_rms is not None,
                                                BLOCK_S=block_s, BLOCK_D=block_d, num_warps=warps)
    # (not exp(logits - lse): fewer digits lost when sharp)
    return torch.softmax(logits, dim=-1) if probs else None, lse, mixed


def phase1_backward(values, inv_rms, queries, probs, grad_mixed, grad_lse, grad_probs, grad_values,
                    accumulate: bool):
    """The gradients of `phase1_forward`: writes (or with `accumulate`, adds) the sources' into `grad_values`
    `(n, B, T, D)` (`None`: not needed) and returns `grad_inv (B, T, n)` fp32 (`None` without the key norm) and
    `grad_queries (S, D)` fp32. `grad_*`: the outputs' gradients or `None`."""
    _check_contiguous(values=values, grad_values=grad_values)
    inv_rms = None if inv_rms is None else inv_rms.contiguous()
    queries, probs = queries.contiguous(), probs.contiguous()
    grad_mixed = None if grad_mixed is None else grad_mixed.contiguous()
    n, batch, seq, dim = values.shape
    S, rows = queries.shape[0], batch * seq
    block_s, block_d, tiles, warps = _phase1_tiles(dim, S)
    grad_scores = probs.new_empty(batch, seq, S, n)
    grad_inv = probs.new_empty(batch, seq, tiles, n) if inv_rms is not None else None  # each query tile's share
    dummy = probs
    with _device_of(values):
        _phase1_backward_kernel[(rows * tiles,)](
            values, inv_rms if inv_rms is not None else dummy, queries, probs,
            grad_mixed if grad_mixed is not None else dummy,
            grad_lse.contiguous() if grad_lse is not None else dummy,
            grad_probs.contiguous() if grad_probs is not None else dummy,
            grad_inv if grad_inv is not None else dummy, grad_scores, n, rows, dim, S, tiles,
            HAS_NORM=inv_rms is not None, HAS_GRAD_MIXED=grad_mixed is not None, HAS_GRAD_LSE=grad_lse is not None,
            HAS_GRAD_PROBS=grad_probs is not None, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=warps)
        if grad_values is not None:  # (from the scores' gradients just written)
            block_s, block_d, chunks, warps = _values_tiles(dim, S)
            _phase1_values_backward_kernel[(rows * chunks,)](
                queries, probs, grad_mixed if grad_mixed is not None else dummy, grad_scores, grad_values, n, rows,
                dim, S, chunks, HAS_GRAD_MIXED=grad_mixed is not None, ACCUMULATE=accumulate, BLOCK_S=block_s,
                BLOCK_D=block_d, num_warps=warps)
    # dL/dw_s = sum over tokens and sources of dL/dscore_si v_i: one (S, n B T) @ (n B T, D) product
    flat = grad_scores.permute(2, 3, 0, 1).reshape(S, n * rows)
    grad_queries = flat @ values.reshape(n * rows, dim).to(torch.float32)
    return (None if grad_inv is None else grad_inv.sum(2)), grad_queries


def _row_view(tensor: torch.Tensor, dim: int) -> int:
    """The stride between tokens of a `(B, T, D)` or `(B, T)` view whose tokens are evenly spaced (a router's slice
    of phase 1's `(B, T, S, D)` outputs); raises `ValueError` otherwise."""
    batch, seq = tensor.shape[:2]
    stride_b, stride_t = tensor.stride(0), tensor.stride(1)
    if tensor.dim() == 3 and tensor.stride(2) != 1:
        raise ValueError("the merge kernel needs unit stride along the hidden axis")
    if batch > 1 and seq > 1 and stride_b != seq * stride_t:
        raise ValueError("the merge kernel needs evenly spaced tokens")
    return stride_t if seq > 1 else stride_b


def merge_forward(partial: torch.Tensor, mixed: torch.Tensor, query: torch.Tensor, lse: torch.Tensor,
                  eps: float, key_norm: bool, output: torch.Tensor | None = None):
    """Phase 2's merge: `partial (B, T, D)` contiguous, `mixed (B, T, D)` (a router's view of phase 1's sums, unit
    stride along `D`), `query (D,)` fp32, `lse (B, T)` fp32 (a view). Returns `hidden (B, T, D)` in the partial
    sum's dtype, `lerp(partial, mixed, sigmoid(lse - p))` in fp32 (the complement its own sigmoid), and the partial
    sum's logit `p (B, T)` fp32.

    With `output (B, T, D)` (a sub-layer's output, contiguous, the partial sum's dtype), the merge reads the partial
    sum `partial + output` instead, computed in the same launch (the add a residual stream makes, fused), and
    returns it third, `(B, T, D)` in the partial sum's dtype (the same numbers as torch's `partial + output`)."""
    if output is not None and (output.shape != partial.shape or output.dtype != partial.dtype):
        raise ValueError(f"output must match the partial sum, {tuple(partial.shape)} {partial.dtype}; got "
                         f"{tuple(output.shape)} {output.dtype}")
    partial, query = partial.contiguous(), query.contiguous()
    batch, seq, dim = partial.shape
    hidden = torch.empty_like(partial)
    logit = partial.new_empty(batch, seq, dtype=torch.float32)
    summed = None if output is None else torch.empty_like(partial)
    block_d, warps = _merge_blocks(dim)
    with _device_of(partial):
        _merge_forward_kernel[(batch * seq,)](
            partial, partial if output is None else output.contiguous(), hidden if summed is None else summed, mixed,
            _row_view(mixed, dim), query, lse, _row_view(lse, dim), hidden, logit, float(eps), dim,
            HAS_NORM=key_norm, HAS_OUTPUT=output is not None, BLOCK_D=block_d, num_warps=warps)
    return (hidden, logit) if output is None else (hidden, logit, summed)


def merge_backward(partial, mixed, query, lse, logit, grad_hidden, grad_logit, eps: float, key_norm: bool):
    """The gradients of `merge_forward`: `grad_partial (B, T, D)` (partial's dtype), `grad_mixed (B, T, D)`
    (mixed's dtype; `None` without `grad_hidden`), `grad_lse (B, T)` fp32 (likewise) and `grad_query (D,)` fp32."""
    partial, query, logit = partial.contiguous(), query.contiguous(), logit.contiguous()
    batch, seq, dim = partial.shape
    grad_partial = torch.empty_like(partial)
    grad_mixed = partial.new_empty(batch, seq, dim, dtype=mixed.dtype) if grad_hidden is not None else None
    grad_lse = logit.new_empty(batch, seq) if grad_hidden is not None else None
    coefficient = torch.empty_like(logit)
    block_d, warps = _merge_blocks(dim)
    with _device_of(partial):
        _merge_backward_kernel[(batch * seq,)](
            partial, mixed, _row_view(mixed, dim), query, lse, _row_view(lse, dim), logit,
            grad_hidden.contiguous() if grad_hidden is not None else logit,
            grad_logit.contiguous() if grad_logit is not None else logit,
            grad_partial, grad_mixed if grad_mixed is not None else logit, grad_lse if grad_lse is not None else logit,
            coefficient, float(eps), dim, HAS_NORM=key_norm, HAS_GRAD_HIDDEN=grad_hidden is not None,
            HAS_GRAD_LOGIT=grad_logit is not None, BLOCK_D=block_d, num_warps=warps)
    grad_query = coefficient.reshape(-1) @ partial.reshape(-1, dim).to(torch.float32)
    return grad_partial, grad_mixed, grad_lse, grad_query
