"""Answer extraction and normalisation for the rule verifiers: pure string functions, linear time.

Nothing here evaluates text as code: numbers are read with ``fractions.Fraction`` from a string that a
regular expression has already matched, and LaTeX is only scanned for braces.
"""

from __future__ import annotations

import re
import string
from fractions import Fraction

# A number as GSM8K writes it: optional sign, digits with optional thousands commas, optional decimals.
NUMBER_RE = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")
MAX_NUMBER_CHARS = 64  # longer digit strings are not read as numbers (no 10^6-digit int parsing)
_BOXED_COMMANDS = ("\\boxed", "\\fbox")
_LATEX_NOISE = ("\\!", "\\,", "\\;", "\\:", "\\ ", "\\left", "\\right", "\\displaystyle")
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\{([^{}]*)\}")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched; None if absent.

    ``\\boxed 5`` (no braces) gives ``5``. An unclosed last box gives None.
    """
    start = max(text.rfind(cmd) for cmd in _BOXED_COMMANDS)
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if i < len(text) and text[i] == " ":  # "\boxed 5" form
        m = re.match(r" +([^\s$]+)", text[i:])
        return m.group(1) if m else None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


def answer_region(text: str) -> tuple[str, bool]:
    """``(region, tagged)``: where a verifier reads an answer. The last ``<answer>...</answer>`` span (a
    ``\\boxed{}`` inside it is unwrapped), else the last ``\\boxed{}`` (``tagged`` True); else the text after
    the last ``</think>``, else the whole response (``tagged`` False). Stripped."""
    low = text.lower()
    end = low.rfind("</answer>")
    start = low.rfind("<answer>", 0, end) if end >= 0 else -1
    if start >= 0:  # two reverse scans: linear time on any text
        inner = text[start + len("<answer>") : end]
        boxed = last_boxed(inner)
        return (boxed if boxed is not None else inner).strip(), True
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, True
    return text.rsplit("</think>", 1)[-1].strip(), False


def strip_latex_noise(s: str) -> str:
    """Remove spacing commands, ``\\left``/``\\right``, ``\\text{...}`` wrappers and ``\\$`` / ``$``."""
    for tok in _LATEX_NOISE:
        s = s.replace(tok, "")
    s = _TEXT_CMD_RE.sub(r"\1", s)
    return s.replace("\\$", "").replace("$", "").replace("\\%", "%").strip()


def parse_number(s: str | None) -> Fraction | None:
    """A plain number (``1,234``, ``-3``, ``18.00``, ``$5``, ``50%`` -> 50, ``7.``) as an exact Fraction.

    Returns None unless the whole (cleaned) string is one number of at most ``MAX_NUMBER_CHARS``.
    """
    if s is None:
        return None
    s = strip_latex_noise(s).replace(" ", "").rstrip(".").removesuffix("%")
    if not s or len(s) > MAX_NUMBER_CHARS or not NUMBER_RE.fullmatch(s):
        return None
    return Fraction(s.replace(",", ""))


def last_number(text: str) -> str | None:
    """The last number in ``text`` (GSM8K flexible extraction), as written (commas kept)."""
    last = None
    for m in NUMBER_RE.finditer(text):
        last = m
    if last is None:
        return None
    s = last.group(0).rstrip(",")
    return s if len(s) <= MAX_NUMBER_CHARS else None


def after_last_hashes(text: str) -> str | None:
    """GSM8K's answer marker: the first number after the last ``####``; None without one."""
    i = text.rfind("####")
    if i < 0:
        return None
    rest = text[i + 4 : i + 4 + 200].replace("\\$", "").replace("$", "").lstrip()
    m = NUMBER_RE.match(rest)
    return m.group(0).rstrip(",") if m else None


def number_key(s: str | None) -> str | None:
    """A canonical string for a number (``1,000.0`` -> ``1000``), for majority voting."""
    value = parse_number(s)
    if value is None:
        return None
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def normalize_text(s: str) -> str:
    """Lower case, LaTeX text wrappers removed, punctuation dropped, whitespace collapsed."""
    s = strip_latex_noise(s).lower()
    s = s.translate(str.maketrans({c: " " for c in string.punctuation}))
    return " ".join(s.split())


def normalize_latex(s: str) -> str:
    """A canonical spelling of a LaTeX answer for voting: noise removed, ``\\dfrac``->``\\frac``, no spaces."""
    s = strip_latex_noise(s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return "".join(s.split()).rstrip(".")


LETTER_WINDOW = 2000  # unboxed letters are looked for in the response's last characters only
_LETTER_PATTERNS = (
    r"(?i:answer)(?:\s+(?i:is))?[\s:]*\(?([A-Z])\)?(?![A-Za-z0-9])",  # "the answer is (C)", "Answer: C"
    r"\(([A-Z])\)",  # "(C)"
)


def _letter_of(span: str, letters: str, choices: list[str] | None) -> str | None:
    core = normalize_text(span).upper()
    if len(core) == 1 and core in letters:
        return core
    if choices:
        key = normalize_latex(span)
        for letter, choice in zip(letters, choices):
            if normalize_latex(choice) == key:
                return letter
    return None


def choice_letter(text: str, letters: str, choices: list[str] | None = None, lenient: bool = True) -> str | None:
    """The chosen letter among ``letters``: the last ``\\boxed{}`` or ``<answer>`` span (a letter, ``(C)``,
    ``C.``, ``\\text{C}``, or a choice's text when ``choices`` are given), else the whole text when it is
    such a letter, else the last "answer is X" / "(X)" in the tail; None if absent. Strict
    (``lenient=False``): the tail must name one letter only (``(A) (B) (C) (D)`` names none)."""
    span, tagged = answer_region(text)
    if tagged:
        return _letter_of(span, letters, choices)
    whole = _letter_of(span, letters, choices) if len(span) <= 64 else None
    if whole is not None:
        return whole
    tail = text[-LETTER_WINDOW:]
    for pattern in _LETTER_PATTERNS:
        found = [m.group(1) for m in re.finditer(pattern, tail) if m.group(1) in letters]
        if found:
            return found[-1] if lenient or len(set(found)) == 1 else None
    return None
