"""Runs the model on a plan: packs inputs, builds the attention layout, returns logits."""

from __future__ import annotations

import torch

from services.scheduler.engine.kv_pool import ReqToTokenPool, TokenToKVPool
from services.scheduler.engine.schedule import Plan
from services.scheduler.layers.attention import AttnMetadata, DecodeLayout, ExtendLayout
from services.scheduler.layers.linear import pack_linears


class ModelRunner:
    """Executes plans against one model and its KV cache.

    A bf16 model on CPU has its linear layers' weights packed for oneDNN here, in place
    (``layers.linear.pack_linears``: same outputs, up to 2x faster at small batch).
    """

    def __init__(self, model: torch.nn.Module, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool):
        pack_linears(model)
        self.model = model
        self.req_pool = req_pool
        self.kv_pool = kv_pool

    @torch.inference_mode()
    def forward(self, plan: Plan) -> torch.Tensor:
        """Run one step -> float32 logits [B, vocab], row i for plan.reqs[i]'s last new token.

        The extend part's tokens are packed first, then one token per decoding request.
        """
        ne = plan.num_extend
        meta = AttnMetadata(plan.out_cache_loc)
        ids, pos = [], []
        last_idx = None
        if ne:
            input_ids, positions, meta.extend, last_idx = self._extend_inputs(plan, ne)
            meta.num_extend_tokens = int(input_ids.numel())
            ids.append(input_ids)
            pos.append(positions)
        if len(plan.reqs) > ne:
            input_ids, positions, meta.decode = self._decode_inputs(plan, ne)
            ids.append(input_ids)
            pos.append(positions)
            if last_idx is not None:
                last_idx = torch.cat((last_idx, meta.num_extend_tokens + torch.arange(len(plan.reqs) - ne)))
        input_ids, positions = (ids[0], pos[0]) if len(ids) == 1 else (torch.cat(ids), torch.cat(pos))
        hidden = self.model(input_ids, positions, meta, self.kv_pool)
        if plan.logprob_rows is not None:  # prompt logprobs: at most a chunk of rows
            plan.logprob_hidden = hidden.index_select(0, plan.logprob_rows.to(hidden.device))
        if last_idx is not None:
            hidden = hidden[last_idx]
        return self.model.compute_logits(hidden)

    def _kv_indices(self, reqs, seq_lens: torch.Tensor) -> torch.Tensor:
        slots = torch.tensor([r.req_slot for r in reqs], dtype=torch.int64)
        return self.req_pool.req_to_token[slots, : int(seq_lens.max())].long()  # [B, L]

    def _decode_inputs(self, plan: Plan, start: int):
        reqs = plan.reqs[start:]
        input_ids = torch.tensor([r.last_token() for r in reqs], dtype=torch.int64)
        positions = torch.tensor(plan.prefix_lens[start:], dtype=torch.int64)  # [B]
        seq_lens = positions + 1
        kv_indices = self._kv_indices(reqs, seq_lens)
        mask = None
        if int(seq_lens.min()) != kv_indices.shape[1]:
            valid = torch.arange(kv_indices.shape[1])[None, :] < seq_lens[:, None]  # [B, L]
            mask = torch.zeros(valid.shape, dtype=torch.float32).masked_fill_(~valid, float("-inf"))
            mask = mask[:, None, None, :]  # [B, 1, 1, L]
        return input_ids, positions, DecodeLayout(kv_indices, seq_lens, mask)

    def _extend_inputs(self, plan: Plan, end: int):
        reqs = plan.reqs[:end]
        ids: list[int] = []
        for req, prefix, n in zip(reqs, plan.prefix_lens, plan.extend_lens):
            ids.extend(req.fill_ids()[prefix : prefix + n])
        input_ids = torch.tensor(ids, dtype=torch.int64)
        prefix = torch.tensor(plan.prefix_lens[:end], dtype=torch.int64)  # [B]
        ext = torch.tensor(plan.extend_lens[:end], dtype=torch.int64)  # [B]
        starts = torch.cumsum(ext, 0) - ext
        lq = int(ext.max())
        i = torch.arange(lq)[None, :]  # [1, Lq]
        # Padded queries repeat their request's last token so every row has a valid key.
        offset = torch.minimum(i, ext[:, None] - 1)  # [B, Lq]
        q_index = starts[:, None] + offset
        q_pos = prefix[:, None] + offset
        q_valid = (torch.arange(len(reqs)) * lq)[:, None] + i
        q_valid = q_valid[i < ext[:, None]]  # [T], packed order
        positions = q_pos.flatten()[q_valid]
        seq_lens = prefix + ext
        kv_indices = self._kv_indices(reqs, seq_lens)
        mask = None
        if len(reqs) > 1 or int(prefix[0]) > 0:
            keys = torch.arange(kv_indices.shape[1])
            mask = (keys[None, None, :] <= q_pos[:, :, None])[:, None]  # [B, 1, Lq, L]
        return input_ids, positions, ExtendLayout(kv_indices, prefix, ext, q_index, q_valid, mask), torch.cumsum(ext, 0) - 1
