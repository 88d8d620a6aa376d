"""Reasoning phases and thinking budgets (``SamplingParams.max_thinking_tokens``), exact under speculation.

Once a reasoning row has generated N tokens without the think end, the target at the next positions
is forced to the think end and the template's separator, so a draft that differs is rejected. Greedy
equals transformers' plain AR with the same intervention (a logits processor) in float64, in every
mode and ragged batch row for row; seeded sampling matches the enumerated forced AR distribution (χ²).
"""
from __future__ import annotations


import pytest
import torch
from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList

from orthrus import OrthrusEngine, SamplingParams
from orthrus.reasoning import ReasoningTokens
from support.oracles import assert_follows, enumerate_ar
from support.qwen3_chat import END_THINK, IM_START, NL2, THINK
from support.tiny_models import hf_twin, tiny_model

# The tiny model writes 13 by itself in three of these rows (at indices 8, 4 and 3); 60 opens thinking.
THINK_TOKENS = ReasoningTokens(start=60, end=13, separator=(2,))
MAX_NEW = 16
# (prompt, budget): forced at 3; forced at 5 (its own 13 would come at 8); its own 13 at the budget
# itself (the separator is still forced after it); forced at the prefill's token (0); its own 13 at
# 3, before the budget (nothing forced); its own 13 at 8 and 16 tokens (nothing forced at 10, nor at 9,
# where a 13 drafted in the same block must close the phase); no
# budget; no reasoning phase (the budget is ignored).
CASES = [([1, 2, 3, 60], 3), ([7, 8, 60], 5), ([9, 10, 11, 12, 13, 60], 4), ([14, 60], 0),
         ([20, 21, 22, 23, 60], 10), ([7, 8, 60], 10), ([7, 8, 60], 9), ([7, 8, 60], None), ([7, 8, 60, 13], 2)]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5, diff_noise=0.3, scale=4.0)


class ForceThinkEnd(LogitsProcessor):
    """Plain AR's intervention: at generated index ``budget`` with no think end before it, only the
    think end, then only each separator token."""

    def __init__(self, prompt_len: int, budget: int, forced: tuple[int, ...]) -> None:
        self.prompt_len, self.budget, self.forced = prompt_len, budget, forced

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[0, self.prompt_len:].tolist()
        offset = len(generated) - self.budget
        if 0 <= offset < len(self.forced) and self.forced[0] not in generated[: self.budget]:
            scores = torch.full_like(scores, float("-inf"))
            scores[0, self.forced[offset]] = 0.0
        return scores


def _hf_greedy(hf, prompt: list[int], budget: int | None, eos: tuple[int, ...]) -> list[int]:
    ids = torch.tensor([prompt])
    force = budget is not None and THINK_TOKENS.opens_reasoning(prompt)
    procs = LogitsProcessorList([ForceThinkEnd(len(prompt), budget, THINK_TOKENS.forced)] if force else [])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                      eos_token_id=list(eos), pad_token_id=0, logits_processor=procs)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("speculative", [True, False, "auto"], ids=["spec", "ar", "auto"])
def test_greedy_thinking_budget_equals_transformers(model, speculative):
    hf = hf_twin(model)
    params = [SamplingParams(max_new_tokens=MAX_NEW, max_thinking_tokens=b) for _, b in CASES]
    engine = OrthrusEngine(model, max_batch_size=3, reasoning=THINK_TOKENS)
    got = engine.generate([p for p, _ in CASES], params, speculative=speculative)     # ragged batch
    for (prompt, budget), sp, r in zip(CASES, params, got):
        assert r.token_ids == _hf_greedy(hf, prompt, budget, model.eos_token_ids)
        alone = OrthrusEngine(model, max_batch_size=1, reasoning=THINK_TOKENS).generate([prompt], sp, speculative=speculative)[0]
        assert alone.token_ids == r.token_ids                                        # the batch changes nothing
    for r in got:     # the iterations that began while thinking emitted the reasoning after the first token
        s, thought = r.stats, r.num_reasoning_tokens or 0
        emitted = s.num_reasoning_accepted_draft_tokens + s.num_reasoning_cycles + s.num_reasoning_ar_steps
        assert max(thought - 1, 0) <= emitted < max(thought - 1, 0) + model.block_size
    reasoning = [r.num_reasoning_tokens for r in got]
    assert reasoning == [4, 6, 5, 1, 4, 9, 9, 9, None]
    assert [r.token_ids[b: b + 2] for r, (_, b) in zip(got[:4], CASES)] == [[13, 2]] * 4   # end + separator
    free = OrthrusEngine(model, max_batch_size=3, reasoning=THINK_TOKENS).generate(
        [p for p, _ in CASES], SamplingParams(max_new_tokens=MAX_NEW))
    assert [f.token_ids != r.token_ids for f, r in zip(free, got)] == [True, True, True, True, False, False, False, False, False]


def test_without_think_tokens_nothing_is_tracked(model):
    """An engine without think tokens (no tokenizer, or ``reasoning=False``) reports no reasoning."""
    for engine in (OrthrusEngine(model, max_batch_size=2), OrthrusEngine(model, reasoning=False)):
        out = engine.generate([[1, 2, 3, 60]], SamplingParams(max_new_tokens=6, max_thinking_tokens=1))[0]
        assert out.num_reasoning_tokens is None and 13 not in out.token_ids[:2]
    with pytest.raises(ValueError, match="reasoning must be"):
        OrthrusEngine(model, reasoning="yes")


def test_budget_validation():
    with pytest.raises(ValueError, match="max_thinking_tokens must be None or an int >= 0"):
        SamplingParams(max_thinking_tokens=-1)
    assert SamplingParams(max_thinking_tokens=4, structured={"regex": "a+"}).max_thinking_tokens == 4


def test_qwen3_think_tokens_and_template(qwen3_tokenizer_dir):
    """Qwen3's released tokenizer and chat template: its ids, and thinking on / off read from the prompt."""
    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    rt = ReasoningTokens.from_tokenizer(tok)
    assert rt == ReasoningTokens(start=THINK, end=END_THINK, separator=(NL2,), turn_start=IM_START)
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    on, off = (tok.encode(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=t))
               for t in (True, False))
    assert rt.opens_reasoning(on) and not rt.opens_reasoning(off)
    assert not rt.opens_reasoning(tok.encode("plain text, no chat template"))
    assert rt.reasoning_length([THINK, 5, END_THINK, NL2, 7]) == 3 and rt.reasoning_length([THINK, 5]) == 2


VOCAB, EOS, HORIZON, BUDGET, N = 7, 5, 4, 1, 20_000
END, SEP = 3, 4
PROMPT = [1, 2, 6, 0]                         # 6 opens thinking
SMALL = ReasoningTokens(start=6, end=END, separator=(SEP,))
PARAMS = dict(temperature=0.9, top_k=5, top_p=0.95, max_new_tokens=HORIZON)


def _exact(model, budget: int | None) -> dict[tuple[int, ...], float]:
    """P(sequence) under the processed AR model with the budget's intervention, by enumeration."""
    force = ForceThinkEnd(len(PROMPT), budget, SMALL.forced) if budget is not None else None

    def adjust(prefix: tuple[int, ...], logits: torch.Tensor) -> torch.Tensor:
        return logits if force is None else force(torch.tensor([PROMPT + list(prefix)]), logits[None])[0]
    return enumerate_ar(model, PROMPT, PARAMS, EOS, adjust)


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [True, False, "auto"], ids=["spec", "ar", "auto"])
def test_sampled_thinking_budget_matches_the_forced_ar_distribution(speculative):
    model = tiny_model(seed=3, vocab=VOCAB, eos=EOS, block_size=3, diff_noise=0.7, scale=3.0)
    engine = OrthrusEngine(model, max_batch_size=512, reasoning=SMALL)
    params = [SamplingParams(seed=s, max_thinking_tokens=BUDGET, **PARAMS) for s in range(N)]
    results = engine.generate([PROMPT] * N, params, speculative=speculative)
    if speculative is True:
        assert sum(r.stats.accept_length_histogram[0] for r in results) > 0        # drafts were rejected too
    assert_follows(results, _exact(model, BUDGET), null=_exact(model, None))


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "ar"])
def test_static_shapes_force_the_same_tokens(model, speculative):
    """The static-shape path (CUDA graphs on a GPU; the same padded iterations on CPU) keys its graphs
    by the thinking path too, and forces exactly what the eager path forces."""
    params = [SamplingParams(max_new_tokens=MAX_NEW, max_thinking_tokens=b) for _, b in CASES]
    prompts = [p for p, _ in CASES]
    static = OrthrusEngine(model, max_batch_size=3, reasoning=THINK_TOKENS, static_shapes=True)
    eager = OrthrusEngine(model, max_batch_size=3, reasoning=THINK_TOKENS)
    assert [o.token_ids for o in static.generate(prompts, params, speculative=speculative)] == \
        [o.token_ids for o in eager.generate(prompts, params, speculative=speculative)]
