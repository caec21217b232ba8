"""Rule verifiers: deterministic rewards from a response and a reference answer, registered by name.

``get_verifier(name)(response, answer, **metadata) -> VerifierResult`` with ``score`` (the reward),
``extracted`` (the answer read from the response, or None), ``correct`` and ``format_ok``, plus
``error`` (why a response was failed without being judged: ``"too_long"``, ``"timeout"``, ...; None
otherwise). The exact definitions are in docs/reward-models.md ("Rule verifiers").

Time limits: a response longer than ``max_response_chars`` fails at once; every other step is a linear
scan of the text, except math-verify's equivalence check, which runs in a worker process that is killed
after ``timeout_s`` (reward_models/math_worker.py). Model text is never evaluated as code.
"""

from __future__ import annotations

from dataclasses import dataclass

from reward_models.judgments import read_verdict
from reward_models.math_answers import (
    after_last_hashes,
    answer_region,
    choice_letter,
    last_boxed,
    last_number,
    normalize_latex,
    normalize_text,
    number_key,
    parse_number,
)
from reward_models.math_worker import math_equivalent
from vlrft.config import ConfigError

MAX_RESPONSE_CHARS = 400_000
MAX_ANSWER_CHARS = 1_000  # extracted answers longer than this are not parsed (math_boxed)
DEFAULT_TIMEOUT_S = 5.0


@dataclass
class VerifierResult:
    score: float  # the reward this verifier gives
    extracted: str | None  # the answer read from the response (None: no answer found)
    correct: bool
    format_ok: bool  # the response used the expected answer format
    error: str | None = None  # why the response was failed unjudged ("too_long", "timeout", ...)


class Verifier:
    """Base class: ``__call__`` applies the response length cap, then :meth:`check`."""

    name = "verifier"
    needs_answer = True  # checks the response against the record's reference answer

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, max_response_chars: int = MAX_RESPONSE_CHARS):
        self.timeout_s = timeout_s
        self.max_response_chars = max_response_chars

    def __call__(self, response: str, answer: str | None = None, **metadata) -> VerifierResult:
        if not isinstance(response, str):
            raise TypeError(f"verifier {self.name!r}: response must be a str, got {type(response).__name__}")
        if len(response) > self.max_response_chars:
            return VerifierResult(0.0, None, False, False, error="too_long")
        return self.check(response, answer, **metadata)

    def check(self, response: str, answer: str | None, **metadata) -> VerifierResult:
        raise NotImplementedError

    def vote_key(self, extracted: str | None) -> str | None:
        """The key under which an extracted answer votes in maj@k (equal keys, same answer)."""
        return None if extracted is None else normalize_text(extracted)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, timeout_s={self.timeout_s})"


class LenientOption(Verifier):
    """A verifier with a strict default reading and a lenient one chosen by ``lenient=True``
    (``verifier_options: {lenient: true}``): lenient readings find an answer among other words, which a
    policy learns to exploit (issue #25: junk naming every answer scored 0.7), so they are opt-in."""

    def __init__(self, lenient: bool = False, **kw):
        super().__init__(**kw)
        if not isinstance(lenient, bool):
            raise TypeError(f"lenient must be true or false, got {lenient!r}")
        self.lenient = lenient

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, lenient={self.lenient}, timeout_s={self.timeout_s})"


def _need_answer(name: str, answer: str | None) -> str:
    if answer is None or not str(answer).strip():
        raise ValueError(f"verifier {name!r} needs a reference answer (the record's 'answer' field is empty)")
    return answer


class GSM8KVerifier(Verifier):
    """The number after the last ``####``, else the last ``\\boxed{}``; flexible mode falls back to the
    last number in the response. Commas, ``$`` and a trailing ``%``/``.`` removed; exact numeric equality.
    A reference answer may be a number or a full GSM8K solution ending in ``#### N``."""

    name = "gsm8k"

    def __init__(self, flexible: bool = False, **kw):
        super().__init__(**kw)
        self.flexible = flexible
        if flexible:
            self.name = "gsm8k_flexible"

    @staticmethod
    def extract(text: str, flexible: bool) -> tuple[str | None, bool]:
        found = after_last_hashes(text)
        if found is None:
            found = last_boxed(text)
        if found is not None:
            return found, True
        return (last_number(text) if flexible else None), False

    def check(self, response, answer, **metadata):
        gold_text = _need_answer(self.name, answer)
        gold = parse_number(after_last_hashes(gold_text) or gold_text)
        if gold is None:
            raise ValueError(f"verifier {self.name!r}: reference answer {gold_text[-80:]!r} is not a number")
        extracted, format_ok = self.extract(response, self.flexible)
        value = parse_number(extracted)
        correct = value is not None and value == gold
        return VerifierResult(float(correct), extracted, correct, format_ok)

    def vote_key(self, extracted):
        return number_key(extracted) if extracted is not None else None


class MathBoxedVerifier(Verifier):
    """The last ``\\boxed{}`` (braces matched) checked for equivalence with the reference by math-verify
    (LaTeX parsing only, in a worker process killed after ``timeout_s``); plain numbers are compared
    exactly without math-verify. Extracted answers over ``max_answer_chars`` are failed unparsed."""

    name = "math_boxed"

    def __init__(self, max_answer_chars: int = MAX_ANSWER_CHARS, **kw):
        super().__init__(**kw)
        self.max_answer_chars = max_answer_chars

    def check(self, response, answer, **metadata):
        gold = _need_answer(self.name, answer).strip()
        boxed = last_boxed(gold)  # a reference may itself be a boxed solution
        gold = boxed if boxed is not None else gold
        extracted = last_boxed(response)
        if extracted is None:
            return VerifierResult(0.0, None, False, False)
        if len(extracted) > self.max_answer_chars:
            return VerifierResult(0.0, extracted, False, True, error="too_long")
        if normalize_latex(extracted) == normalize_latex(gold):
            return VerifierResult(1.0, extracted, True, True)
        a, b = parse_number(gold), parse_number(extracted)
        if a is not None and a == b:  # unequal numbers still go to math-verify (50\% vs 0.5)
            return VerifierResult(1.0, extracted, True, True)

        equal = math_equivalent(gold, extracted, self.timeout_s)
        if equal is None:
            return VerifierResult(0.0, extracted, False, True, error="timeout")
        return VerifierResult(float(equal), extracted, equal, True)

    def vote_key(self, extracted):
        if extracted is None:
            return None
        return number_key(extracted) or normalize_latex(extracted)


class MultipleChoiceVerifier(LenientOption):
    """A choice letter (default A-D; ``metadata['choices']`` sets how many): the last ``<answer>`` or
    ``\\boxed{}`` span (a letter, or a choice's text), else the whole response when it is one, else the last
    "answer is X" / "(X)" in the tail. Strict (default): a tail that names several letters gives no answer;
    ``lenient=True``: the last one named. The reference is a letter, or a choice's text when ``choices``
    are given. ``format_ok``: the answer came in a tagged span."""

    name = "multiple_choice"

    def check(self, response, answer, **metadata):
        gold = _need_answer(self.name, answer).strip()
        choices = metadata.get("choices")
        letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[: len(choices)] if choices else "ABCD"
        gold_letter = (choice_letter(gold, letters, choices) if len(gold) > 1 else gold.upper()) or ""
        if (len(gold_letter) != 1 or gold_letter not in letters) and choices:
            keys = [normalize_latex(c) for c in choices]
            gold_letter = letters[keys.index(normalize_latex(gold))] if normalize_latex(gold) in keys else ""
        if len(gold_letter) != 1 or gold_letter not in letters:
            raise ValueError(f"verifier {self.name!r}: reference answer {gold!r} is not one of the letters {letters}")
        extracted = choice_letter(response, letters, choices, lenient=self.lenient)
        correct = extracted == gold_letter
        return VerifierResult(float(correct), extracted, correct, answer_region(response)[1])


class FormatVerifier(Verifier):
    """1.0 when the response is ``<think>reasoning</think>`` followed by an answer containing a
    ``\\boxed{}`` (one think block, at the start, non-empty reasoning), else 0.0. Needs no answer."""

    name = "format"
    needs_answer = False

    def check(self, response, answer, **metadata):
        text = response.strip()
        ok = text.startswith("<think>") and text.count("<think>") == 1 and text.count("</think>") == 1
        boxed = None
        if ok:
            reasoning, after = text[len("<think>") :].split("</think>", 1)
            boxed = last_boxed(after)
            ok = bool(reasoning.strip()) and boxed is not None
        return VerifierResult(float(ok), boxed, ok, ok)


class LengthPenaltyVerifier(Verifier):
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13): with L = length,
    L_max = ``max_length``, L_cache = ``cache_length``: 0 if L <= L_max - L_cache;
    ((L_max - L_cache) - L) / L_cache if L_max - L_cache < L <= L_max; -1 if L > L_max.
    L is ``metadata['response_length']`` (tokens, as the trainer passes it) when given, else characters."""

    name = "length_penalty"
    needs_answer = False

    def __init__(self, max_length: int = 4096, cache_length: int = 1024, **kw):
        super().__init__(**kw)
        if not 0 < cache_length <= max_length:
            raise ValueError(f"length_penalty: need 0 < cache_length <= max_length, got {cache_length}, {max_length}")
        self.max_length, self.cache_length = max_length, cache_length

    def __call__(self, response, answer=None, **metadata):
        return self.check(response, answer, **metadata)  # no length cap: long responses are its input

    def check(self, response, answer, **metadata):
        length = metadata.get("response_length")
        length = len(response) if length is None else int(length)
        start = self.max_length - self.cache_length
        if length <= start:
            score = 0.0
        elif length <= self.max_length:
            score = (start - length) / self.cache_length
        else:
            score = -1.0
        return VerifierResult(score, None, score == 0.0, True)


class ExactMatchVerifier(Verifier):
    """Normalised string equality (lower case, punctuation and extra whitespace removed) between the
    reference and the answer region (:func:`~reward_models.math_answers.answer_region`: the last
    ``<answer>`` span, else the last ``\\boxed{}``, else the text after ``</think>``, else the whole response).
    The whole region must equal the reference: a right word among others is not an answer."""

    name = "exact_match"

    def check(self, response, answer, **metadata):
        gold = normalize_text(_need_answer(self.name, answer))
        extracted, tagged = answer_region(response)
        correct = bool(gold) and normalize_text(extracted) == gold
        return VerifierResult(float(correct), extracted or None, correct, tagged)


class VocabAnswerVerifier(LenientOption):
    """Closed-vocabulary answers (synthetic tasks: colours, shapes, counts, yes/no). Strict (default): the
    answer region (as ``exact_match``) must be exactly one word of the record's ``vocabulary`` metadata
    (without a ``vocabulary``: exactly one word), compared with the reference after :func:`normalize_text`;
    ``"the colour is red"`` or ``"red red blue"`` give no answer. ``lenient=True``: the first vocabulary
    word anywhere in the region. ``format_ok``: the region is exactly one vocabulary word (both readings)."""

    name = "vocab_answer"

    def read(self, response: str, vocabulary) -> tuple[str | None, bool]:
        """``(answer word or None, format_ok)``."""
        region = normalize_text(answer_region(response)[0])
        words = region.split()
        vocab = {normalize_text(str(v)) for v in vocabulary} if vocabulary else None
        exact = len(words) == 1 and (vocab is None or words[0] in vocab)
        if not self.lenient:
            return (words[0] if exact else None), exact
        return next((w for w in words if vocab is None or w in vocab), None), exact

    def check(self, response, answer, vocabulary=None, **metadata):
        gold = normalize_text(_need_answer(self.name, answer))
        extracted, format_ok = self.read(response, vocabulary)
        correct = extracted is not None and extracted == gold
        return VerifierResult(float(correct), extracted, correct, format_ok)


class VocabFormatVerifier(VocabAnswerVerifier):
    """Format reward of closed-vocabulary tasks, right or wrong: strict (default) 1 when the answer region
    is exactly one word of the record's ``vocabulary``; ``lenient=True``: 1 when it names any (R1-style
    format credit, which junk naming every word also earns)."""

    name = "vocab_format"
    needs_answer = False

    def check(self, response, answer, vocabulary=None, **metadata):
        extracted, format_ok = self.read(response, vocabulary)
        found = extracted is not None
        return VerifierResult(float(found), extracted, found, format_ok)


class JudgeVerdictVerifier(LenientOption):
    """Judge RL (``data.record_kind: judgment``): 1 when the judge's verdict equals the record's verdict
    (its ``answer``: ``A``/``B``/``tie`` or ``yes``/``no``) in the record's ``judge_mode``. Strict (default):
    the last ``<answer>`` tag, else the whole response when it is one verdict word (``" B "``); lenient: else
    the first verdict word anywhere (:func:`~reward_models.judgments.read_verdict` ``tolerant``).
    ``format_ok`` when the verdict came in a tag."""

    name = "judge_verdict"

    def verdict(self, response: str, judge_mode: str) -> tuple[str | None, bool]:
        got, tagged = read_verdict(response, judge_mode, tolerant=self.lenient)
        whole = response.strip()
        if got is None and not tagged and not self.lenient and len(whole) <= 16:  # a verdict word, alone
            got = read_verdict(f"<answer>{whole}</answer>", judge_mode)[0]
        return got, tagged

    def check(self, response, answer, judge_mode="pairwise", **metadata):
        gold, _ = read_verdict(f"<answer>{_need_answer(self.name, answer)}</answer>", judge_mode)
        if gold is None:
            raise ValueError(f"verifier {self.name!r}: reference {answer!r} is not a {judge_mode} verdict")
        got, tagged = self.verdict(response, judge_mode)
        return VerifierResult(float(got == gold), got, got == gold, tagged)


class JudgeFormatVerifier(JudgeVerdictVerifier):
    """Format reward of judge RL: 1 when a verdict can be read (right or wrong; read as ``judge_verdict``)."""

    name = "judge_format"
    needs_answer = False

    def check(self, response, answer, judge_mode="pairwise", **metadata):
        got, tagged = self.verdict(response, judge_mode)
        return VerifierResult(float(got is not None), got, got is not None, tagged)


VERIFIERS: dict[str, Verifier] = {
    v.name: v
    for v in (
        GSM8KVerifier(),
        GSM8KVerifier(flexible=True),
        MathBoxedVerifier(),
        MultipleChoiceVerifier(),
        FormatVerifier(),
        LengthPenaltyVerifier(),
        ExactMatchVerifier(),
        VocabAnswerVerifier(),
        VocabFormatVerifier(),
        JudgeVerdictVerifier(),
        JudgeFormatVerifier(),
    )
}


def check_verifier(name: str, key: str, **options) -> None:
    """Refuse (``ConfigError`` naming ``key``) a verifier name that is not registered, or options it does not take."""
    if name not in VERIFIERS:
        raise ConfigError(f"{key}={name}: unknown verifier; known: {', '.join(VERIFIERS)}")
    try:
        get_verifier(name, **options)
    except TypeError as exc:
        raise ConfigError(f"{key}={name}: bad verifier_options {options} ({exc})") from None


def get_verifier(name: str | Verifier, **options) -> Verifier:
    """The registered verifier ``name``; with ``options``, a new one of its kind configured by them
    (e.g. ``get_verifier("math_boxed", timeout_s=2)``, ``get_verifier("length_penalty", max_length=512)``).
    A :class:`Verifier` object (e.g. a reward function source's) is returned as it is."""
    if isinstance(name, Verifier):
        return name
    if name not in VERIFIERS:
        raise KeyError(f"unknown verifier {name!r}; known: {', '.join(sorted(VERIFIERS))}")
    base = VERIFIERS[name]
    if not options:
        return base
    if isinstance(base, GSM8KVerifier):
        options.setdefault("flexible", base.flexible)
    return type(base)(**options)
