"""The sampling options of synthetic-data jobs (vLLM's meanings), exact under speculation.

``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``min_p`` and
``ignore_eos``. Each position of a cycle is penalised with the token counts as of that position
(drafts before it included), so greedy rows equal transformers' ``generate`` with the equivalent
logits processors (float64, every mode, a ragged batch beside rows without options, each row alone
the same), and seeded sampling matches the enumerated AR distribution with the same rules (χ²).
"""
from __future__ import annotations


import numpy as np
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from orthrus import OrthrusEngine, SamplingParams
from support.oracles import assert_follows, enumerate_ar
from support.tiny_models import hf_twin, tiny_model

MAX_NEW = 14


class PresenceFrequency(LogitsProcessor):
    """The reference rule of presence and frequency penalties (vLLM's, over the generated tokens)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def _processors(prompt: list[int], sp: SamplingParams) -> LogitsProcessorList:
    """transformers' processors for ``sp``, in the engine's (vLLM's) order: bias, repetition, the rest."""
    out = LogitsProcessorList()
    if sp.logit_bias:
        out.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in sp.logit_bias]))
    if sp.repetition_penalty != 1:
        out.append(RepetitionPenaltyLogitsProcessor(sp.repetition_penalty))
    if sp.presence_penalty or sp.frequency_penalty:
        out.append(PresenceFrequency(len(prompt), sp.presence_penalty, sp.frequency_penalty))
    return out


def _hf_greedy(hf, prompt: list[int], sp: SamplingParams, eos: tuple[int, ...]) -> list[int]:
    ids = torch.tensor([prompt])
    stops = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(eos))
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                      logits_processor=_processors(prompt, sp), eos_token_id=stops or [10 ** 6], pad_token_id=0)
    return out[0, len(prompt):].tolist()


# Rows that loop or end early without their option, so that each option changes its row.
PROMPTS = [[1, 2, 3], [20, 21, 22, 23], [5, 6], [14], [40, 41], [9, 10, 11, 12, 13], [50, 51, 52]]
OPTIONS = [
    {},
    {"repetition_penalty": 1.8},
    {"frequency_penalty": 1.5, "presence_penalty": 0.8},
    {"logit_bias": {3: 6.0, 25: -100.0}},
    {"repetition_penalty": 0.7, "frequency_penalty": -0.4, "logit_bias": {43: 2.5}, "stop_token_ids": (13,)},
    {"ignore_eos": True, "min_p": 0.3},
    {"presence_penalty": 2.0, "logit_bias": {10: 4.0}},
]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5, diff_noise=0.3, scale=4.0)


@pytest.mark.parametrize("speculative", [True, False, "auto"], ids=["spec", "ar", "auto"])
def test_greedy_options_equal_transformers(model, speculative):
    hf = hf_twin(model)
    params = [SamplingParams(max_new_tokens=MAX_NEW, **o) for o in OPTIONS]
    engine = OrthrusEngine(model, max_batch_size=3)                 # ragged, slots refilled
    got = engine.generate(PROMPTS, params, speculative=speculative)
    plain = engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW), speculative=speculative)
    for prompt, sp, r, p in zip(PROMPTS, params, got, plain):
        assert r.token_ids == _hf_greedy(hf, prompt, sp, model.eos_token_ids), sp
        alone = OrthrusEngine(model, max_batch_size=1).generate([prompt], sp, speculative=speculative)[0]
        assert alone.token_ids == r.token_ids                                   # the batch changes nothing
        if sp.penalized or sp.logit_bias:
            assert r.token_ids != p.token_ids, f"{sp} changed nothing: the case has no power"
    assert len(got[5].token_ids) == MAX_NEW and model.eos_token_ids[0] in got[5].token_ids[:-1]   # ignore_eos
    assert got[0].token_ids == plain[0].token_ids


def test_speculation_verifies_penalties_within_a_block(model):
    """Drafts repeat tokens inside a cycle, so a position's counts must include the drafts before it:
    a repetition-heavy row accepts drafts and still equals plain AR."""
    sp = SamplingParams(max_new_tokens=40, frequency_penalty=0.6, repetition_penalty=1.2)
    engine = OrthrusEngine(model, max_batch_size=2)
    spec, ar = (engine.generate([[20, 21, 22, 23]], sp, speculative=m)[0] for m in (True, False))
    assert spec.token_ids == ar.token_ids
    assert spec.stats.num_accepted_draft_tokens > 0


VOCAB, EOS, HORIZON, N = 7, 5, 4, 20_000
PROMPT = [1, 2, 3, 0]
PENALTIES = dict(repetition_penalty=1.6, frequency_penalty=0.5, presence_penalty=0.4, logit_bias={2: 1.2, 4: -0.8})
PARAMS = dict(temperature=0.9, top_k=0, top_p=0.95, min_p=0.08, max_new_tokens=HORIZON)


def _exact(model, penalties: dict) -> dict[tuple[int, ...], float]:
    """P(sequence) of AR sampling with the penalties applied as vLLM does, by enumeration."""
    bias = penalties.get("logit_bias", {})
    rep, freq, pres = (penalties.get(k, d) for k, d in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                                                        ("presence_penalty", 0.0)))

    def adjust(prefix: tuple[int, ...], logits: torch.Tensor) -> torch.Tensor:
        for t, b in bias.items():
            logits[t] += b
        for t in set(PROMPT) | set(prefix):
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t in set(prefix):
            logits[t] -= freq * prefix.count(t) + pres
        return logits
    return enumerate_ar(model, PROMPT, PARAMS, EOS, adjust)


@pytest.mark.slow
def test_sampled_options_match_the_penalised_ar_distribution():
    model = tiny_model(seed=3, vocab=VOCAB, eos=EOS, block_size=3, diff_noise=0.7, scale=3.0)
    engine = OrthrusEngine(model, max_batch_size=512)
    params = [SamplingParams(seed=s, **PARAMS, **PENALTIES) for s in range(N)]
    results = engine.generate([PROMPT] * N, params, speculative=True)
    assert sum(r.stats.num_accepted_draft_tokens for r in results) > 0       # drafts were accepted too
    assert_follows(results, _exact(model, PENALTIES), null=_exact(model, {}))


def _mixed(temperature: float) -> list[SamplingParams]:
    """Rows with and without options, seeded (sampled rows are then reproducible run to run)."""
    return [SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, seed=i, **o) for i, o in enumerate(OPTIONS)]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_static_shapes_and_one_host_read_with_options(model, temperature):
    """The static path (what CUDA graphs capture) gives the eager path's tokens with options, and
    the options add no device→host read (one per step that reads) and no host→device copy beyond
    one per step and one per admitting step."""
    from orthrus.testing.host_syncs import count_host_reads

    params = _mixed(temperature)
    eager = OrthrusEngine(model, max_batch_size=4, static_shapes=False).generate(PROMPTS, params, speculative=True)
    engine = OrthrusEngine(model, max_batch_size=4, static_shapes=True)
    with count_host_reads() as reads:
        static = engine.generate(PROMPTS, params, speculative=True)
    assert [r.token_ids for r in static] == [r.token_ids for r in eager]
    stats = engine.stats
    assert dict(reads) == {"cpu": stats.read_steps, "h2d_async": stats.read_steps + stats.admitting_steps}


def test_rows_without_options_keep_their_paths_and_hold_no_counts(model):
    """A batch without penalties never allocates the [B, V] counts nor turns a path on."""
    engine = OrthrusEngine(model, max_batch_size=3)
    engine.generate(PROMPTS[:3], SamplingParams(max_new_tokens=4, temperature=0.5, seed=1))
    assert engine.runner.state.counts is None
    seated = engine.scheduler.table.settings
    assert seated.paths(np.arange(3)) == {"filtered": False, "min_p": False, "penalties": False, "bias": False}
    engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, presence_penalty=0.5))
    assert engine.runner.state.counts is not None


def test_token_ids_past_the_vocabulary_are_refused_naming_the_field(model):
    engine = OrthrusEngine(model, max_batch_size=1)
    for params, field in ((SamplingParams(logit_bias={64: 1.0}), "logit_bias"),
                          (SamplingParams(stop_token_ids=(70,), min_tokens=2), "stop_token_ids")):
        with pytest.raises(ValueError, match=f"SamplingParams.{field} token ids must be < the vocabulary size 64"):
            engine.add_request([1, 2], params)
    for bad, message in (({"repetition_penalty": 0}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
                         ({"min_p": 1.5}, "min_p"), ({"logit_bias": {1: 101}}, "logit_bias values"),
                         ({"logit_bias": {-1: 1}}, "logit_bias keys"), ({"ignore_eos": 1}, "ignore_eos"),
                         ({"ignore_eos": True, "structured": {"regex": "a"}}, "ignore_eos cannot be combined")):
        with pytest.raises(ValueError, match=f"SamplingParams.{message}"):
            SamplingParams(**bad)
