"""The closed-vocabulary verifiers of the synthetic tasks (the embedded train-policy default): strict by
default (the answer region must be exactly one vocabulary word), lenient by option (issue #25: the lenient
reading paid 0.7 for junk such as ``" least yes_ yes option yes yes COL"``)."""

import pytest

from reward_models.verifiers import get_verifier

V = ["red", "green", "blue", "yellow"]
# (response, gold, strict (score, extracted), lenient (score, extracted), format_ok)
CASES = [
    ("red", "red", (1.0, "red"), (1.0, "red"), True),
    ("Red.", "red", (1.0, "red"), (1.0, "red"), True),
    ("  RED  ", "red", (1.0, "red"), (1.0, "red"), True),
    (" red\n", "red", (1.0, "red"), (1.0, "red"), True),
    (
        "red<|im_end|>",
        "red",
        (0.0, None),
        (1.0, "red"),
        False,
    ),  # special tokens are stripped before scoring in practice
    ("the colour is red", "red", (0.0, None), (1.0, "red"), False),
    ("blue red", "red", (0.0, None), (0.0, "blue"), False),  # lenient: the first vocabulary word counts
    ("red blue", "red", (0.0, None), (1.0, "red"), False),
    ("red red red", "red", (0.0, None), (1.0, "red"), False),  # the right answer repeated
    ("red green blue yellow", "red", (0.0, None), (1.0, "red"), False),  # the vocabulary enumerated
    (" least red_ option red red COL", "red", (0.0, None), (1.0, "red"), False),  # the junk
    ("green", "red", (0.0, "green"), (0.0, "green"), True),
    ("reddish", "red", (0.0, None), (0.0, None), False),  # a word containing the answer is not the answer
    ("", "red", (0.0, None), (0.0, None), False),
    ("   ", "red", (0.0, None), (0.0, None), False),
    ("nothing here", "red", (0.0, None), (0.0, None), False),
    ("<think>maybe blue</think> red", "red", (1.0, "red"), (1.0, "red"), True),  # the region follows </think>
    ("<think>red</think> blue red", "red", (0.0, None), (0.0, "blue"), False),
    ("\\boxed{yellow}", "yellow", (1.0, "yellow"), (1.0, "yellow"), True),
    ("I think \\boxed{blue} red", "red", (0.0, "blue"), (0.0, "blue"), True),  # the last \boxed{} wins over free text
    ("The colour is \\boxed{red}.", "red", (1.0, "red"), (1.0, "red"), True),  # a tagged span may sit in prose
    ("<answer>red</answer>", "red", (1.0, "red"), (1.0, "red"), True),
    ("<answer> Red </answer> and more", "red", (1.0, "red"), (1.0, "red"), True),
    ("<answer>red blue</answer>", "red", (0.0, None), (1.0, "red"), False),
    ("\\boxed{red blue}", "red", (0.0, None), (1.0, "red"), False),
    ("purple", "red", (0.0, None), (0.0, None), False),  # outside this record's vocabulary
]


@pytest.mark.parametrize("response, gold, strict, lenient, format_ok", CASES)
def test_vocab_answer_table(response, gold, strict, lenient, format_ok):
    for verifier, want in (
        (get_verifier("vocab_answer"), strict),
        (get_verifier("vocab_answer", lenient=True), lenient),
    ):
        res = verifier(response, gold, vocabulary=V)
        assert (res.score, res.extracted, res.format_ok) == (*want, format_ok), verifier
        assert res.correct == (want[0] == 1.0)


@pytest.mark.parametrize("response, gold, strict, lenient, format_ok", CASES)
def test_vocab_format_credits_exactly_one_vocabulary_word(response, gold, strict, lenient, format_ok):
    """Format credit, right or wrong: strict only for a region that is one vocabulary word (so junk that
    names a word among others earns nothing); lenient for any vocabulary word named."""
    assert get_verifier("vocab_format")(response, None, vocabulary=V).score == float(format_ok)
    assert get_verifier("vocab_format", lenient=True)(response, None, vocabulary=V).score == float(
        lenient[1] is not None
    )


def test_without_vocabulary_the_whole_region_is_one_word():
    strict, lenient = get_verifier("vocab_answer"), get_verifier("vocab_answer", lenient=True)
    assert strict("3", "3").score == 1.0 and strict("3 circles", "3").score == 0.0
    assert lenient("3 circles", "3").score == 1.0 and lenient("circles 3", "3").score == 0.0


def test_missing_reference_is_an_error_and_lenient_must_be_a_bool():
    with pytest.raises(ValueError, match="vocab_answer"):
        get_verifier("vocab_answer")("red", None, vocabulary=V)
    with pytest.raises(TypeError, match="lenient must be true or false"):
        get_verifier("vocab_answer", lenient="yes")
