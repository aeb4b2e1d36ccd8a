"""The harness's speculative workload, small: where prompts quote themselves the engine takes
fewer target steps with the same greedy answers and copies no K/V to roll drafts back; sampled
text runs too (drafts rarely match)."""

import pytest

pytest.importorskip("transformers")

from vmcache.bench import speculation as spec  # noqa: E402


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_quoting_prompts_take_fewer_steps_with_the_same_answers(kind):
    m = spec.model()
    none, ngram, mask, forks = spec.rows_for(m, kind, "quoting", 2, 1)
    for tree in (mask, forks):
        assert tree["answers_equal_none"] is True and tree["tree_steps"] > 0
    # the mask copies only a winning branch's tokens; a fork copies its branch page always
    assert mask["tree_copied_bytes"] < forks["tree_copied_bytes"]
    assert mask["mapped_pages_per_verify"] < forks["mapped_pages_per_verify"]
    assert ngram["answers_equal_none"] is True
    assert ngram["steps"] < none["steps"] and ngram["spec_accepted"] > 0
    assert ngram["rolled_back_tokens"] == ngram["spec_proposed"] - ngram["spec_accepted"]
    assert ngram["cow_bytes_copied"] == 0
    none, ngram, *_ = spec.rows_for(m, kind, "sampled", 2, 1)
    assert ngram["generated_tokens"] == none["generated_tokens"] == 2 * spec.NEW
    assert ngram["answers_equal_none"] is None
