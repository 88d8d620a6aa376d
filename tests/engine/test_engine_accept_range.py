"""Acceptance bookkeeping over the whole range L = 0 … K-1, driven by a replaying proposer."""
from __future__ import annotations

import torch

from orthrus import OrthrusEngine, SamplingParams
from support.tiny_models import tiny_model

K = 5


class ReplayProposer:
    """Proposes the AR model's own greedy continuation, corrupted so that exactly L drafts match.

    L is chosen per (row, position) by a fixed rule that cycles through 0 … K-1. The engine passes
    slots; which request (row) sits in a slot the proposer reads from the engine's slot table (the
    test adds row ``i`` as request id ``str(i)``).
    """

    def __init__(self, sequences: list[list[int]], vocab: int) -> None:
        self.sequences = sequences
        self.vocab = vocab
        self.planned: list[tuple[int, int, int]] = []   # (row, position, L)
        self.engine: OrthrusEngine | None = None

    def row(self, slot: int) -> int:
        return int(self.engine.scheduler.table.requests[slot].request_id)

    def propose(self, anchor, batch, cache, slots, backend):
        b, k = batch.positions.shape
        logits = torch.zeros(b, k - 1, self.vocab, dtype=torch.float64)
        for i in range(b):   # test-only code: per-row Python is fine here
            row, n = self.row(int(slots[i])), int(batch.positions[i, 0])
            seq = self.sequences[row]
            want = (n * 3 + row) % k                     # drafts 1..want are right, want+1 is wrong
            self.planned.append((row, n, want))
            for j in range(k - 1):
                tok = seq[n + 1 + j] if n + 1 + j < len(seq) else 0
                if j == want:
                    tok = (tok + 1) % (self.vocab - 1)
                logits[i, j, tok] = 10.0
        return logits


def test_replay_proposer_hits_every_accept_length_and_stays_exact():
    model = tiny_model(seed=2, block_size=K, scale=4.0)
    prompts = [[1, 2, 3], [7, 8], [9, 10, 11, 12, 13], [14], [20, 21, 22]]
    params = SamplingParams(max_new_tokens=40)
    ref_engine = OrthrusEngine(model, max_batch_size=2)
    ref = ref_engine.generate(prompts, params, speculative=False)
    # the AR continuation, K tokens longer so even the last block's drafts are scored as planned
    longer = ref_engine.generate(prompts, SamplingParams(max_new_tokens=40 + K), speculative=False)
    sequences = [p + r.token_ids for p, r in zip(prompts, longer)]
    proposer = ReplayProposer(sequences, model.config.vocab_size)
    # every draft verified: the histogram must reach L = K-1 (a verify budget would cut blocks short)
    engine = proposer.engine = OrthrusEngine(model, max_batch_size=2, proposer=proposer, adaptive_verify=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i))
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
    got = [done[str(i)] for i in range(len(prompts))]
    hist = [0] * K
    for r, want in zip(got, ref):
        assert r.token_ids == want.token_ids and r.finish_reason == want.finish_reason
        hist = [a + b for a, b in zip(hist, r.stats.accept_length_histogram)]
    assert all(c > 0 for c in hist), hist                 # every L in 0 … K-1 was exercised
    # each cycle accepted exactly the planned number of drafts (counted before a stop truncates)
    for row, (r, full) in enumerate(zip(got, longer)):
        planned = [0] * K
        for prow, _, want in proposer.planned:
            planned[want] += prow == row
        if full.finish_reason == "length":   # no EOS inside the replayed continuation
            assert r.stats.accept_length_histogram == planned, (row, planned)
