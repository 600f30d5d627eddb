"""Per-token log-probabilities and entropies from hidden states, never holding [N, V] logits.

    logits_n = hidden_n @ weight^T / temperature
    logprob_n = log_softmax(logits_n)[target_n]
    entropy_n = -sum_v p_nv log p_nv

The dense path loops over token chunks: forward keeps only logsumexp, target logit and
entropy per row; backward recomputes each chunk's logits and forms the exact gradient.
On CUDA (bf16/fp16/fp32) dense rows go to the Triton kernels of `logprobs_triton.py`
instead: same outputs and gradients, logits accumulated in fp32 (this path rounds each
chunk's logits to the input dtype first, as a bf16 matmul returns them).
With `support` (sampling-mask replay) each row is renormalised over its kept ids instead.
Under trainer tensor parallelism the LM head is sharded by vocabulary rows and
`vocab_parallel_token_logprobs` runs the same chunked loop on each rank's shard, combining
per-row log-sum-exp, target-logit and entropy statistics across ranks with all-reduces.

Normalisation domain of the importance ratio exp(trainer - generator): both sides use the
distribution the token was sampled from, softmax(logits / temperature) restricted to the
generator's kept support (top-k, then top-p; see generation/sampling.py) and renormalised
over it. The generator records that support per position (`SamplingParams.return_support`,
set by the rollouter whenever top-p < 1 or top-k > 0); the trainer passes it as `support`
and gets log pi_theta(a | s, support). Rows without truncation (an empty support range:
top-p = 1 and top-k = 0, or greedy) use the full vocabulary on both sides. The entropy of a
replayed row is that of the same truncated distribution.

Shape suffixes: N = tokens (rows), D = hidden size, V = vocabulary, C = rows of one chunk,
K = (row, id) entries of the support, E = entries of one chunk of the support.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist
from torch import Tensor

SUPPORT_ENTRIES_PER_ROW = 16
"""Support entries per dense row in one chunk: an entry costs D, a dense row V, so take more."""


def token_logprobs(
    hidden_ND: Tensor,
    weight_VD: Tensor,
    targets_N: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    support: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each target (and entropy of its distribution), differentiable and exact.

    Outputs are float32 (float64 when the inputs are float64); gradients come back in the
    input dtype. `support = (support_ids_K, support_offsets)` is CSR: row n keeps
    `support_ids_K[offsets[n]:offsets[n + 1]]` (ids distinct or not, the target is added when
    absent); a row with an empty range keeps the full vocabulary.
    Example: offsets = [0, 2, 2], ids = [5, 9] -> row 0 over {5, 9, target_0}, row 1 over V.
    """
    _check_inputs(hidden_ND, weight_VD, targets_N, temperature, chunk_size)
    if support is not None:
        return _support_logprobs(
            hidden_ND, weight_VD, targets_N, support, temperature, chunk_size, with_entropy
        )
    if _triton_serves(hidden_ND):
        # The fused CUDA kernel: same arguments, same outputs, same gradients.
        from torchtitan_rl.losses import logprobs_triton

        return logprobs_triton.token_logprobs(
            hidden_ND, weight_VD, targets_N, temperature=temperature, with_entropy=with_entropy
        )
    outputs = _ChunkedLogprobs.apply(
        hidden_ND, weight_VD, targets_N, 1.0 / temperature, chunk_size, with_entropy
    )
    if with_entropy:
        return outputs[0], outputs[1]
    return outputs, None


TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Input dtypes the Triton kernel takes (tl.dot has no float64 path); others stay dense."""


def _triton_serves(hidden_ND: Tensor) -> bool:
    """Whether `losses/logprobs_triton.py` computes these rows: CUDA, Triton importable, a
    dtype tl.dot supports, and at least one row (a launch grid cannot be empty)."""
    if hidden_ND.device.type != "cuda" or hidden_ND.dtype not in TRITON_DTYPES:
        return False
    return hidden_ND.shape[0] > 0 and importlib.util.find_spec("triton") is not None


def _check_inputs(
    hidden_ND: Tensor, weight_VD: Tensor, targets_N: Tensor, temperature: float, chunk_size: int
) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden_ND.dim() != 2 or weight_VD.dim() != 2 or hidden_ND.shape[1] != weight_VD.shape[1]:
        raise ValueError(
            f"hidden_ND must be [N, D] and weight_VD [V, D], got {tuple(hidden_ND.shape)} "
            f"and {tuple(weight_VD.shape)}"
        )
    if targets_N.shape != (hidden_ND.shape[0],):
        raise ValueError(
            f"targets_N must be [N] = [{hidden_ND.shape[0]}], got {tuple(targets_N.shape)}"
        )
    if hidden_ND.dtype != weight_VD.dtype:
        raise ValueError(f"hidden_ND is {hidden_ND.dtype} but weight_VD is {weight_VD.dtype}")


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16/fp32 inputs, float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logp(h_CD: Tensor, weight_VD: Tensor, inv_temperature: float) -> Tensor:
    """Unnormalised log-probs of one chunk: matmul in the input dtype, then upcast."""
    logits_CV = (h_CD @ weight_VD.T).to(_accum_dtype(h_CD.dtype))
    return logits_CV.mul_(inv_temperature)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, inv_temperature, chunk_size, with_entropy):
        n = hidden_ND.shape[0]
        acc = _accum_dtype(hidden_ND.dtype)
        lse_N = torch.empty(n, dtype=acc, device=hidden_ND.device)
        logprobs_N = torch.empty(n, dtype=acc, device=hidden_ND.device)
        entropy_N = torch.empty(n, dtype=acc, device=hidden_ND.device) if with_entropy else None
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            z_CV = _chunk_logp(hidden_ND[rows], weight_VD, inv_temperature)
            lse_C = torch.logsumexp(z_CV, dim=-1)
            lse_N[rows] = lse_C
            logprobs_N[rows] = z_CV.gather(1, targets_N[rows, None]).squeeze(1) - lse_C
            if with_entropy:
                logp_CV = z_CV.sub_(lse_C[:, None])
                entropy_N[rows] = -(logp_CV.exp() * logp_CV).sum(-1)
        ctx.save_for_backward(hidden_ND, weight_VD, targets_N, lse_N, entropy_N)
        ctx.inv_temperature = inv_temperature
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)
        if with_entropy:
            return logprobs_N, entropy_N
        return logprobs_N

    @staticmethod
    def backward(ctx, grad_logprobs_N, grad_entropy_N=None):
        hidden_ND, weight_VD, targets_N, lse_N, entropy_N = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logprobs_N is None and grad_entropy_N is None) or not (need_h or need_w):
            return None, None, None, None, None, None
        grad_h_ND, grad_w_VD = _chunked_input_grads(
            ctx, hidden_ND, weight_VD, targets_N, lse_N, entropy_N, grad_logprobs_N, grad_entropy_N
        )
        return (
            grad_h_ND.to(hidden_ND.dtype) if need_h else None,
            grad_w_VD.to(weight_VD.dtype) if need_w else None,
            None,
            None,
            None,
            None,
        )


def _chunked_input_grads(
    ctx,
    hidden_ND,
    weight_VD,
    targets_N,
    lse_N,
    entropy_N,
    grad_logprobs_N,
    grad_entropy_N,
    in_shard_N=None,
):
    """Recompute each chunk's logits and accumulate (grad_hidden, grad_weight) in fp32 (or
    fp64); either is None when autograd does not need it. With `in_shard_N` (vocab-parallel),
    targets are shard-local ids and the hidden gradient is this shard's partial sum."""
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    acc = _accum_dtype(hidden_ND.dtype)
    grad_h_ND = torch.zeros(hidden_ND.shape, dtype=acc, device=hidden_ND.device) if need_h else None
    grad_w_VD = torch.zeros(weight_VD.shape, dtype=acc, device=weight_VD.device) if need_w else None
    for start in range(0, hidden_ND.shape[0], ctx.chunk_size):
        rows = slice(start, start + ctx.chunk_size)
        h_CD = hidden_ND[rows]
        logp_CV = _chunk_logp(h_CD, weight_VD, ctx.inv_temperature).sub_(lse_N[rows, None])
        g_CV = _chunk_grad_logits(
            logp_CV,
            targets_N[rows],
            None if grad_logprobs_N is None else grad_logprobs_N[rows].to(acc),
            None if grad_entropy_N is None else grad_entropy_N[rows].to(acc),
            None if entropy_N is None else entropy_N[rows],
            None if in_shard_N is None else in_shard_N[rows],
        ).mul_(ctx.inv_temperature)
        g_CV = g_CV.to(hidden_ND.dtype)
        if need_h:
            grad_h_ND[rows] = (g_CV @ weight_VD).to(acc)
        if need_w:
            grad_w_VD += (g_CV.T @ h_CD).to(acc)
    return grad_h_ND, grad_w_VD


def _chunk_grad_logits(
    logp_CV: Tensor,
    targets_C: Tensor,
    grad_logprobs_C: Tensor | None,
    grad_entropy_C: Tensor | None,
    entropy_C: Tensor | None,
    in_shard_C: Tensor | None = None,
) -> Tensor:
    """d(loss)/d(logits / temperature), overwriting `logp_CV` to keep one extra [C, V] buffer.

    d logprob / dz = onehot(target) - p;  d entropy / dz = -p * (log p + H).
    `in_shard_C` (vocab-parallel): rows whose target lies in this shard; only they get the
    onehot term (`targets_C` then holds shard-local ids).
    """
    p_CV = logp_CV.exp()
    if grad_entropy_C is not None:
        g_CV = logp_CV.add_(entropy_C[:, None]).mul_(p_CV).mul_(-grad_entropy_C[:, None])
        if grad_logprobs_C is not None:
            g_CV.addcmul_(p_CV, grad_logprobs_C[:, None], value=-1.0)
    else:
        g_CV = p_CV.mul_(-grad_logprobs_C[:, None])
    if grad_logprobs_C is not None:
        if in_shard_C is not None:
            grad_logprobs_C = torch.where(in_shard_C, grad_logprobs_C, 0.0)
        g_CV.scatter_add_(1, targets_C[:, None], grad_logprobs_C[:, None])
    return g_CV


def vocab_parallel_token_logprobs(
    hidden_ND: Tensor,
    weight_shard_VD: Tensor,
    targets_N: Tensor,
    *,
    vocab_start: int,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` over a vocabulary whose rows are split across the ranks of `group`.

    Every rank passes the same `hidden_ND` and `targets_N` (global ids) and its own rows
    `weight_shard_VD = weight[vocab_start : vocab_start + V_shard]`; every rank gets the
    same full-vocabulary log-probs and entropies, and no rank holds more than [C, V_shard]
    logits. Backward: the hidden-state gradient is summed over ranks (every rank gets the
    full one), each shard's weight gradient stays on its rank. Exact, like the dense path.

    Per row, rank r with shard logits z (m_r = max z) contributes
        s_r = sum exp(z - m_r),  t_r = sum exp(z - m_r) * (z - m_r),  a_r = z[target] or 0
    and with M = max_r m_r (all-reduce max), w_r = exp(m_r - M), one all-reduce (sum) gives
        S = sum w_r s_r,  T = sum w_r (t_r + (m_r - M) s_r),  A = sum a_r
        lse = M + log S,  logprob = A - lse,  entropy = log S - T / S.
    Example: V = 5 on 2 ranks -> rank 0 holds rows 0..2 (vocab_start 0), rank 1 rows 3..4
    (vocab_start 3), as `torch.chunk` and DTensor's Shard(0) split them.
    """
    _check_inputs(hidden_ND, weight_shard_VD, targets_N, temperature, chunk_size)
    if weight_shard_VD.shape[0] < 1 or vocab_start < 0:
        raise ValueError(
            f"weight_shard_VD must hold >= 1 row and vocab_start must be >= 0, got "
            f"{weight_shard_VD.shape[0]} rows from {vocab_start}"
        )
    outputs = _VocabParallelLogprobs.apply(
        hidden_ND, weight_shard_VD, targets_N, 1.0 / temperature, chunk_size, with_entropy,
        vocab_start, group,
    )  # fmt: skip
    if with_entropy:
        return outputs[0], outputs[1]
    return outputs, None


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden_ND, weight_VD, targets_N, inv_temperature, chunk_size, with_entropy,
        vocab_start, group,
    ):  # fmt: skip
        n, v_shard = hidden_ND.shape[0], weight_VD.shape[0]
        acc = _accum_dtype(hidden_ND.dtype)
        local_N = targets_N - vocab_start
        in_shard_N = (local_N >= 0) & (local_N < v_shard)
        local_N = torch.where(in_shard_N, local_N, 0)
        max_N = torch.empty(n, dtype=acc, device=hidden_ND.device)
        sums_3N = torch.zeros(3, n, dtype=acc, device=hidden_ND.device)  # s, t, a
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            z_CV = _chunk_logp(hidden_ND[rows], weight_VD, inv_temperature)
            target_C = z_CV.gather(1, local_N[rows, None]).squeeze(1)
            sums_3N[2, rows] = torch.where(in_shard_N[rows], target_C, 0.0)
            max_C = z_CV.max(dim=-1).values
            max_N[rows] = max_C
            z_CV.sub_(max_C[:, None])
            e_CV = z_CV.exp()
            sums_3N[0, rows] = e_CV.sum(-1)
            if with_entropy:
                sums_3N[1, rows] = (e_CV * z_CV).sum(-1)
        global_max_N = max_N.clone()
        dist.all_reduce(global_max_N, op=dist.ReduceOp.MAX, group=group)
        shift_N = max_N - global_max_N
        w_N = shift_N.exp()
        sums_3N[1] = w_N * (sums_3N[1] + shift_N * sums_3N[0])
        sums_3N[0] *= w_N
        dist.all_reduce(sums_3N, group=group)
        log_s_N = sums_3N[0].log()
        lse_N = global_max_N + log_s_N
        logprobs_N = sums_3N[2] - lse_N
        entropy_N = log_s_N - sums_3N[1] / sums_3N[0] if with_entropy else None
        ctx.save_for_backward(hidden_ND, weight_VD, local_N, in_shard_N, lse_N, entropy_N)
        ctx.inv_temperature, ctx.chunk_size, ctx.group = inv_temperature, chunk_size, group
        ctx.set_materialize_grads(False)
        if with_entropy:
            return logprobs_N, entropy_N
        return logprobs_N

    @staticmethod
    def backward(ctx, grad_logprobs_N, grad_entropy_N=None):
        hidden_ND, weight_VD, local_N, in_shard_N, lse_N, entropy_N = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        none = (None,) * 8
        if (grad_logprobs_N is None and grad_entropy_N is None) or not (need_h or need_w):
            return none
        # fp32 partial sums: the all-reduce below adds the shards' shares of the gradient
        grad_h_ND, grad_w_VD = _chunked_input_grads(
            ctx,
            hidden_ND,
            weight_VD,
            local_N,
            lse_N,
            entropy_N,
            grad_logprobs_N,
            grad_entropy_N,
            in_shard_N,
        )
        if need_h:  # every rank must join, so the condition is the same on every rank
            dist.all_reduce(grad_h_ND, group=ctx.group)
        return (
            grad_h_ND.to(hidden_ND.dtype) if need_h else None,
            grad_w_VD.to(weight_VD.dtype) if need_w else None,
            *none[2:],
        )


def _support_logprobs(
    hidden_ND: Tensor,
    weight_VD: Tensor,
    targets_N: Tensor,
    support: tuple[Tensor, Tensor],
    temperature: float,
    chunk_size: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """Rows with a non-empty support go through `_renormalised_logprobs`; the rest are dense."""
    n, vocab = hidden_ND.shape[0], weight_VD.shape[0]
    device = hidden_ND.device
    support_ids_K, offsets = (t.to(device=device, dtype=torch.long) for t in support)
    if offsets.shape != (n + 1,):
        raise ValueError(f"support offsets must be [N + 1] = [{n + 1}], got {tuple(offsets.shape)}")
    if int(offsets[0]) != 0 or int(offsets[-1]) != support_ids_K.shape[0]:
        raise ValueError(
            f"support offsets must run from 0 to len(support_ids) = {support_ids_K.shape[0]}, "
            f"got {int(offsets[0])}..{int(offsets[-1])}"
        )
    counts_N = offsets[1:] - offsets[:-1]
    if bool((counts_N < 0).any()):
        raise ValueError("support offsets must be non-decreasing")
    if (
        support_ids_K.numel()
        and not 0 <= int(support_ids_K.min()) <= int(support_ids_K.max()) < vocab
    ):
        raise ValueError(f"support ids must lie in [0, V) = [0, {vocab})")
    kept_N = counts_N > 0
    sparse_rows = kept_N.nonzero().squeeze(1)
    dense_rows = (~kept_N).nonzero().squeeze(1)
    if sparse_rows.numel() == 0:
        return token_logprobs(
            hidden_ND, weight_VD, targets_N, temperature=temperature,
            chunk_size=chunk_size, with_entropy=with_entropy,
        )  # fmt: skip
    # One sorted, deduplicated (row, id) key per entry; every kept row also gets its target.
    row_of_id_K = torch.repeat_interleave(torch.arange(n, device=device), counts_N)
    keys_K = torch.cat(
        [row_of_id_K * vocab + support_ids_K, sparse_rows * vocab + targets_N[sparse_rows]]
    )
    keys_K = torch.unique(keys_K)
    row_K, id_K = keys_K // vocab, keys_K % vocab
    logprobs_N, entropy_N = _renormalised_logprobs(
        hidden_ND, weight_VD, targets_N, row_K, id_K, 1.0 / temperature, chunk_size, with_entropy
    )
    if dense_rows.numel() == 0:
        return logprobs_N, entropy_N
    dense_logprobs, dense_entropy = token_logprobs(
        hidden_ND[dense_rows], weight_VD, targets_N[dense_rows], temperature=temperature,
        chunk_size=chunk_size, with_entropy=with_entropy,
    )  # fmt: skip
    logprobs_N = logprobs_N.index_copy(0, dense_rows, dense_logprobs)
    if with_entropy:
        entropy_N = entropy_N.index_copy(0, dense_rows, dense_entropy)
    return logprobs_N, entropy_N


def _renormalised_logprobs(
    hidden_ND: Tensor,
    weight_VD: Tensor,
    targets_N: Tensor,
    row_K: Tensor,
    id_K: Tensor,
    inv_temperature: float,
    chunk_size: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """Segment log-softmax over the (row, id) entries; rows without entries come out 0."""
    n = hidden_ND.shape[0]
    entries_per_chunk = chunk_size * SUPPORT_ENTRIES_PER_ROW
    z_K = _GatheredLogits.apply(hidden_ND, weight_VD, row_K, id_K, entries_per_chunk)
    z_K = z_K * inv_temperature
    # The max only shifts for stability; its gradient cancels exactly, so it is detached.
    max_N = torch.full((n,), float("-inf"), dtype=z_K.dtype, device=z_K.device)
    max_N = max_N.scatter_reduce(0, row_K, z_K.detach(), reduce="amax")
    max_N = torch.where(torch.isfinite(max_N), max_N, 0.0)
    sumexp_N = torch.zeros_like(max_N).index_add(0, row_K, torch.exp(z_K - max_N[row_K]))
    lse_N = max_N + torch.log(torch.where(sumexp_N > 0, sumexp_N, 1.0))
    logp_K = z_K - lse_N[row_K]
    is_target_K = id_K == targets_N[row_K]
    logprobs_N = torch.zeros_like(max_N).index_add(0, row_K[is_target_K], logp_K[is_target_K])
    if not with_entropy:
        return logprobs_N, None
    entropy_N = -torch.zeros_like(max_N).index_add(0, row_K, logp_K.exp() * logp_K)
    return logprobs_N, entropy_N


class _GatheredLogits(torch.autograd.Function):
    """z_K = hidden[row_K] . weight[id_K], in chunks of entries so no [K, D] buffer lives on.

    Each dot is taken in float32 and rounded to the input dtype before the upcast, so a
    support logit equals the dense path's bf16 matmul output up to summation order.
    """

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, row_K, id_K, chunk_size):
        acc = _accum_dtype(hidden_ND.dtype)
        z_K = torch.empty(row_K.shape[0], dtype=acc, device=hidden_ND.device)
        for start in range(0, row_K.shape[0], chunk_size):
            e = slice(start, start + chunk_size)
            h_ED = hidden_ND[row_K[e]].to(acc)
            w_ED = weight_VD[id_K[e]].to(acc)
            z_K[e] = (h_ED * w_ED).sum(-1).to(hidden_ND.dtype).to(acc)
        ctx.save_for_backward(hidden_ND, weight_VD, row_K, id_K)
        ctx.chunk_size = chunk_size
        return z_K

    @staticmethod
    def backward(ctx, grad_z_K):
        hidden_ND, weight_VD, row_K, id_K = ctx.saved_tensors
        acc = grad_z_K.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h_ND = (
            torch.zeros(hidden_ND.shape, dtype=acc, device=hidden_ND.device) if need_h else None
        )
        grad_w_VD = (
            torch.zeros(weight_VD.shape, dtype=acc, device=weight_VD.device) if need_w else None
        )
        for start in range(0, row_K.shape[0], ctx.chunk_size):
            e = slice(start, start + ctx.chunk_size)
            g_E1 = grad_z_K[e, None]
            if need_h:
                grad_h_ND.index_add_(0, row_K[e], g_E1 * weight_VD[id_K[e]].to(acc))
            if need_w:
                grad_w_VD.index_add_(0, id_K[e], g_E1 * hidden_ND[row_K[e]].to(acc))
        return (
            grad_h_ND.to(hidden_ND.dtype) if need_h else None,
            grad_w_VD.to(weight_VD.dtype) if need_w else None,
            None,
            None,
            None,
        )
