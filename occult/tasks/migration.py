"""Luffy's sequence migration (``task.migration``; arXiv 2411.15419, harness implementation).

Before the first decoder block, once per step, each sequence moves to the rank that holds
most of its (token, expert) pairs summed over the MoE layers; its attention runs there
(every block of the model), and its last hidden states return to the home rank, where the
LM head and the loss are computed. The computation of each sequence is the same wherever
it runs, so the model's outputs and gradients are unchanged (exact; tests/test_migration.py).

Where a sequence's pairs will go is not known before it runs; it is predicted from a table
counted from the previous step's routing: for each vocabulary token, the mean number of its
(token, expert) pairs that went to each rank, summed over the MoE layers (a sequence's
score for rank r is the sum over its tokens). The first step's table comes from a
profiling pass: the step's own batch through the model without migration, with no gradient
and on a recorder of its own. Every rank keeps the table of the tokens it ran.

The assignment keeps every rank's batch at B sequences (attention load balanced): every
rank gathers every sequence's scores (an accounted all-gather, phase ``migration_plan``)
and assigns greedily, the highest (sequence, rank) score first (ties: the home rank, then
the lower rank and sequence), a rank taking at most B; every rank computes the same.

Accounted: the hidden states of each sequence once each way (phases ``migrate`` and
``migrate_return``, and their gradients in the backward), its token ids (``migrate_ids``,
metadata), and the counters ``migrated_sequences``, ``remote_pairs_home`` (the step's
(token, expert) pairs whose expert is off the sequence's home rank) and
``remote_pairs_migrated`` (off the rank it ran on), at layer -1. Decode is refused
(the KV cache would move too; not implemented).

Shapes: B sequences per rank, S sequence length, D hidden, V vocabulary, P ranks,
T = B * S tokens, G = P * B sequences of the world.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
from torch import nn

from ..ep import Recorder
from ..ep.accounting import active_recorder, recording
from ..ep.comm import Exchange, all_gather_rows, all_to_all_rows
from ..ep.permute import gather_rows, inverse_permutation

LAYER = -1          # the layer column of the migration's collectives and counters


def balanced_assignment(score_GP: torch.Tensor, per_rank: int) -> torch.Tensor:
    """Each sequence's rank: greedy on the (sequence, rank) scores, highest first (ties: the
    home rank ``g // per_rank``, then the lower rank, then the lower sequence), each rank
    taking at most ``per_rank`` sequences. [G, P] -> [G] (long)."""
    G, P = score_GP.shape
    home_G = torch.arange(G) // per_rank
    score = score_GP.detach().double().cpu()
    keys = sorted(((-float(score[g, r]), int(r != home_G[g]), r, g) for g in range(G) for r in range(P)))
    dest_G, load_P = [-1] * G, [0] * P
    for _, _, r, g in keys:
        if dest_G[g] < 0 and load_P[r] < per_rank:
            dest_G[g], load_P[r] = r, load_P[r] + 1
    return torch.tensor(dest_G, dtype=torch.long)


def pairs_per_rank(routing: list, placements: dict, world_size: int, num_tokens: int, device) -> torch.Tensor:
    """Each token's (token, expert) pairs on each rank, summed over the MoE layers of one
    forward's routing (``Recorder.routing`` entries; dropped pairs left out). [T, P]."""
    counts_TP = torch.zeros(num_tokens, world_size, dtype=torch.float64, device=device)
    for layer, ids_TK, *_ in routing:
        kept_TK = ids_TK >= 0
        device_TK, _ = placements[layer].pair_local(ids_TK.clamp_min(0))
        counts_TP.scatter_add_(1, device_TK.long(), kept_TK.to(counts_TP.dtype))
    return counts_TP


def token_table(ids_T: torch.Tensor, counts_TP: torch.Tensor, vocab: int) -> torch.Tensor:
    """The mean of each vocabulary token's pairs on each rank over its occurrences (zeros for
    a token not seen). [V, P]."""
    table_VP = counts_TP.new_zeros(vocab, counts_TP.shape[1]).index_add_(0, ids_T, counts_TP)
    seen_V = torch.bincount(ids_T, minlength=vocab).to(table_VP.dtype)
    return table_VP / seen_V.clamp_min(1).unsqueeze(1)


class MigratingModel(nn.Module):
    """A rank's causal LM whose sequences run where their experts are (see the module).
    ``placements``: ``{layer: placement}`` of the model's MoE layers. Called as the model
    is (``input_ids``, no cache); returns an object with ``logits``. The routing table is
    the one piece of state it keeps between steps (the previous step's routing)."""

    def __init__(self, ctx, model: nn.Module, placements: dict):
        super().__init__()
        self.model = model
        self.ctx, self.placements = ctx, placements
        self.vocab = model.get_input_embeddings().num_embeddings
        self.table_VP: Optional[torch.Tensor] = None

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False, **_):
        if use_cache:
            raise ValueError("task.migration: a migrated sequence's KV cache is not moved (decode is not supported)")
        rec = active_recorder() or Recorder(rank=self.ctx.rank)
        with recording(rec):
            if self.table_VP is None:
                self.table_VP = self._profile(input_ids)
            return SimpleNamespace(logits=self._migrated_forward(input_ids, rec))

    def _profile(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The profiling pass: the batch through the model where it is, no gradient, on a
        recorder of its own; the table of its routing. [V, P]."""
        rec = Recorder(rank=self.ctx.rank)
        with torch.no_grad(), recording(rec):
            self.model(input_ids=input_ids, use_cache=False)
        counts_TP = pairs_per_rank(rec.routing, self.placements, self.ctx.world_size, input_ids.numel(),
                                   input_ids.device)
        return token_table(input_ids.flatten(), counts_TP, self.vocab)

    def _migrated_forward(self, input_ids: torch.Tensor, rec: Recorder) -> torch.Tensor:
        ep, rank, P = self.ctx.ep, self.ctx.rank, self.ctx.world_size
        B, S = input_ids.shape
        score_BP = self.table_VP[input_ids].sum(1)
        score_GP = all_gather_rows(score_BP, [B] * P, ep, Exchange(LAYER, "migration_plan", rec, metadata=True))
        dest_G = balanced_assignment(score_GP, B).to(input_ids.device)
        mine_B = dest_G[rank * B:(rank + 1) * B]
        order_B = torch.argsort(mine_B, stable=True)
        send_P = (torch.bincount(mine_B, minlength=P) * S).tolist()
        arrive_G = torch.nonzero(dest_G == rank).flatten()          # the sequences this rank runs, (source, b) order
        recv_P = (torch.bincount(arrive_G // B, minlength=P) * S).tolist()
        row_T = (order_B.unsqueeze(1) * S + torch.arange(S, device=input_ids.device)).flatten()
        h_TD = gather_rows(self.model.get_input_embeddings()(input_ids).flatten(0, 1), row_T)
        h_TD = all_to_all_rows(h_TD, send_P, recv_P, ep, Exchange(LAYER, "migrate", rec))
        ids_T = all_to_all_rows(input_ids.flatten()[row_T].unsqueeze(1), send_P, recv_P, ep,
                                Exchange(LAYER, "migrate_ids", rec, metadata=True)).flatten()
        n0 = len(rec.routing)
        out_TD = self.model.model(inputs_embeds=h_TD.view(-1, S, h_TD.shape[-1]),
                                  use_cache=False).last_hidden_state.flatten(0, 1)
        self._count(rec, rec.routing[n0:], ids_T, arrive_G, mine_B, B, S)
        back_TD = all_to_all_rows(out_TD, recv_P, send_P, ep, Exchange(LAYER, "migrate_return", rec))
        home_TD = gather_rows(back_TD, inverse_permutation(row_T))
        return self.model.lm_head(home_TD.view(B, S, -1))

    def _count(self, rec: Recorder, routing: list, ids_T: torch.Tensor, arrive_G: torch.Tensor,
               mine_B: torch.Tensor, B: int, S: int) -> None:
        """The step's counters from its routing (of the sequences this rank ran), and the
        table for the next step."""
        rank, P = self.ctx.rank, self.ctx.world_size
        counts_TP = pairs_per_rank(routing, self.placements, P, ids_T.numel(), ids_T.device)
        counts_GP = counts_TP.view(-1, S, P).sum(1)
        total_G = counts_GP.sum(1)
        home_G = arrive_G // B
        rec.log_counter(LAYER, "migrated_sequences", float((mine_B != rank).sum()))
        rec.log_counter(LAYER, "remote_pairs_home", float((total_G - counts_GP.gather(1, home_G[:, None])[:, 0]).sum()))
        rec.log_counter(LAYER, "remote_pairs_migrated", float((total_G - counts_GP[:, rank]).sum()))
        self.table_VP = token_table(ids_T, counts_TP, self.vocab)
