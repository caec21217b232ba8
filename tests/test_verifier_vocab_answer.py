"""The closed-vocabulary verifier of the synthetic tasks (the embedded train-policy default)."""

import pytest

from reward_models.verifiers import get_verifier

V = ["red", "green", "blue", "yellow"]
CASES = [
    ("red", "red", 1.0, "red", True),
    ("Red.", "red", 1.0, "red", True),
    ("  RED  ", "red", 1.0, "red", True),
    ("red<|im_end|>", "red", 1.0, "red", False),  # special tokens are stripped before scoring in practice
    ("the colour is red", "red", 1.0, "red", False),
    ("blue red", "red", 0.0, "blue", False),  # the first vocabulary word counts
    ("green", "red", 0.0, "green", True),
    ("reddish", "red", 0.0, None, False),  # a word containing the answer is not the answer
    ("", "red", 0.0, None, False),
    ("nothing here", "red", 0.0, None, False),
    ("<think>maybe blue</think> red", "red", 1.0, "red", True),  # the answer region follows </think>
    ("\\boxed{yellow}", "yellow", 1.0, "yellow", True),
    ("I think \\boxed{blue} red", "red", 0.0, "blue", True),  # the last \boxed{} wins over free text
    ("purple", "red", 0.0, None, False),  # outside this record's vocabulary
]


@pytest.mark.parametrize("response, gold, score, extracted, format_ok", CASES)
def test_vocab_answer_table(response, gold, score, extracted, format_ok):
    res = get_verifier("vocab_answer")(response, gold, vocabulary=V)
    assert (res.score, res.extracted, res.format_ok) == (score, extracted, format_ok)
    assert res.correct == (score == 1.0)


def test_without_vocabulary_the_first_word_is_compared():
    v = get_verifier("vocab_answer")
    assert v("3 circles", "3").score == 1.0
    assert v("circles 3", "3").score == 0.0


def test_missing_reference_is_an_error():
    with pytest.raises(ValueError, match="vocab_answer"):
        get_verifier("vocab_answer")("red", None, vocabulary=V)
