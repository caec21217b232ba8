"""Chat formatting: records as Qwen-VL chat messages, with optional system prompt and prompt template.

``build_messages(record)`` returns ``[{"role": "system", ...}?, {"role": "user", "content": [...]}]``
where the user content lists ``{"type": "image", "image": PIL.Image}``, ``{"type": "video", "video": path}`` and
``{"type": "text", "text": ...}`` items in the order of the record's ``<image>``/``<video>`` placeholders (a kind
with none goes first). The list
goes straight into ``processor.apply_chat_template``; a text-only Qwen tokenizer's template wants
string contents, which :func:`text_only_messages` makes from the same list. A prompt template is a
format string with ``{prompt}`` or a name in ``PROMPT_TEMPLATES``; it wraps the prompt text,
placeholders included, before the split.

The judge format (generative reward models): the system turn :data:`JUDGE_SYSTEM_PROMPT` and the user
turn :data:`POINTWISE_JUDGE_TEMPLATE` with the record's images; the target, what
``reward_models.generative.parse_judgment`` reads, is ``[rationale ]<answer>yes|no</answer>``.
"""

from __future__ import annotations

import re
from typing import Any

from PIL import Image

from data_pipelines.images import load_image
from data_pipelines.records import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, JudgmentRecord, PromptRecord

# Instruction suffixes as the peers use them (EasyR1's math template, verl's GSM8K instruction).
PROMPT_TEMPLATES: dict[str, str] = {
    "plain": "{prompt}",
    "math_boxed": (
        "{prompt} You FIRST think about the reasoning process as an internal monologue and then provide the "
        "final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer "
        "MUST BE put in \\boxed{{}}."
    ),
    "gsm8k": '{prompt} Let\'s think step by step and output the final answer after "####".',
    "answer_tag": "{prompt} Put your final answer within <answer> </answer> tags.",
}

# The judge prompt the reward pool uses for a (prompt, response): the instruction is the system turn and
# the candidate answer ends the user turn, right before the judgment (a tiny judge learns this layout
# several times faster than one with the instruction after the candidate). Images go first (or at <image>).
JUDGE_SYSTEM_PROMPT = (
    "You are a judge. Reply <answer>yes</answer> if the candidate answer to the question is correct, "
    "otherwise <answer>no</answer>."
)
POINTWISE_JUDGE_TEMPLATE = "Question: {prompt}\nCandidate answer: {response}"
# The pairwise judge format: two responses shown as A and B; the verdict is A, B or tie
# (reward_models.judgments reads it).
PAIRWISE_JUDGE_SYSTEM_PROMPT = (
    "You are a judge. Compare the two responses to the question and reply <answer>A</answer> if Response A "
    "is better, <answer>B</answer> if Response B is better, or <answer>tie</answer> if they are equally good."
)
PAIRWISE_JUDGE_TEMPLATE = "Question: {prompt}\nResponse A: {a}\nResponse B: {b}"


def resolve_template(prompt_template: str | None) -> str:
    """The format string for a template name or a literal template (which must contain ``{prompt}``)."""
    if prompt_template is None:
        return "{prompt}"
    if prompt_template in PROMPT_TEMPLATES:
        return PROMPT_TEMPLATES[prompt_template]
    if "{prompt}" not in prompt_template:
        raise ValueError(
            f"prompt_template {prompt_template!r} is neither a name in PROMPT_TEMPLATES "
            f"({', '.join(PROMPT_TEMPLATES)}) nor a format string with {{prompt}}"
        )
    return prompt_template


def apply_template(prompt: str, prompt_template: str | None) -> str:
    return resolve_template(prompt_template).format(prompt=prompt)


def user_content(
    text: str, images: list[Any], image_kwargs: dict[str, Any] | None = None, videos: list[Any] = ()
) -> list[dict[str, Any]]:
    """Content items for ``text`` with ``<image>`` and ``<video>`` placeholders; a kind without placeholders goes
    before the text (images, then videos). Videos stay as given (a path or a frame list, decoded when the processor
    encodes them: ``{"type": "video", "video": ...}``)."""
    pil = [im if isinstance(im, Image.Image) else load_image(im, **(image_kwargs or {})) for im in images]
    items = {IMAGE_PLACEHOLDER: [{"type": "image", "image": im} for im in pil]}
    items[VIDEO_PLACEHOLDER] = [{"type": "video", "video": v} for v in videos]
    pieces = re.split(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})", text)
    content: list[dict[str, Any]] = []
    for mark, parts in items.items():
        slots = pieces.count(mark)
        if not slots:  # no placeholders of this kind: its items first
            content += parts
            items[mark] = []
        elif slots != len(parts):
            kind = "images" if mark == IMAGE_PLACEHOLDER else "videos"
            raise ValueError(f"prompt has {slots} {mark} placeholders but {len(parts)} {kind}")
    for piece in pieces:
        if piece in items:
            content.append(items[piece].pop(0))
        elif piece:
            content.append({"type": "text", "text": piece})
    return content


def build_messages(
    record: Any,
    *,
    system_prompt: str | None = None,
    prompt_template: str | None = None,
    response: str | None = None,
    image_kwargs: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Qwen-VL chat messages for a prompt record, preference pair or judgment record.

    The record's own ``system`` wins over ``system_prompt`` (a run-wide default). ``response`` appends an
    assistant turn (e.g. a pair's ``chosen`` or a judgment's ``target``). Images that are not yet PIL
    images are loaded with :func:`~data_pipelines.images.load_image` (``image_kwargs``).
    """
    messages: list[dict[str, Any]] = []
    system = getattr(record, "system", None) or system_prompt
    if system:
        messages.append({"role": "system", "content": [{"type": "text", "text": system}]})
    text = apply_template(record.prompt, prompt_template)
    videos = list(getattr(record, "videos", ()))
    messages.append({"role": "user", "content": user_content(text, list(record.images), image_kwargs, videos)})
    if response is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": response}]})
    return messages


def text_only_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with list contents joined into strings: text-only Qwen chat templates concatenate
    ``message['content']`` as a string (the Qwen-VL templates take the list form)."""
    return [
        {
            **m,
            "content": m["content"]
            if isinstance(m["content"], str)
            else "".join(c.get("text", "") for c in m["content"]),
        }
        for m in messages
    ]


def judgment_prompt(prompt: str, response: str, template: str = POINTWISE_JUDGE_TEMPLATE) -> str:
    """The judge's user text for one response (``<image>`` placeholders of the prompt are kept)."""
    return template.replace("{prompt}", prompt).replace("{response}", response)


def judge_target(verdict: str, rationale: str = "") -> str:
    """A judge's training target, pointwise or pairwise: ``[rationale ]<answer>verdict</answer>``."""
    return (f"{rationale} " if rationale else "") + f"<answer>{verdict}</answer>"


def pointwise_judgment_record(
    record: PromptRecord,
    response: str,
    correct: bool,
    rationale: str = "",
    template: str = POINTWISE_JUDGE_TEMPLATE,
    system: str = JUDGE_SYSTEM_PROMPT,
) -> JudgmentRecord:
    """A judge training record in the judge format: target ``[rationale ]<answer>yes|no</answer>``."""
    verdict = "yes" if correct else "no"
    return JudgmentRecord(
        id=f"{record.id}/{response}",
        prompt=judgment_prompt(record.prompt, response, template),
        images=record.images,
        videos=record.videos,
        target=judge_target(verdict, rationale),
        task=record.task,
        system=system,
        metadata={**record.metadata, "candidate": response, "verdict": verdict},
    )


def pairwise_prompt(prompt: str, a: str, b: str, template: str = PAIRWISE_JUDGE_TEMPLATE) -> str:
    """The pairwise judge's user text (``<image>`` placeholders of ``prompt`` are kept)."""
    return template.replace("{prompt}", prompt).replace("{a}", a).replace("{b}", b)


def pairwise_judgment_record(
    record: PromptRecord,
    a: str,
    b: str,
    verdict: str,
    template: str = PAIRWISE_JUDGE_TEMPLATE,
    system: str = PAIRWISE_JUDGE_SYSTEM_PROMPT,
    rationale: str = "",
) -> JudgmentRecord:
    """A pairwise judge record: responses ``a`` and ``b``, target ``[rationale ]<answer>A|B|tie</answer>``."""
    if verdict not in ("A", "B", "tie"):
        raise ValueError(f"a pairwise verdict is A, B or tie, got {verdict!r}")
    return JudgmentRecord(
        id=f"{record.id}/{a}|{b}",
        prompt=pairwise_prompt(record.prompt, a, b, template),
        images=record.images,
        videos=record.videos,
        target=judge_target(verdict, rationale),
        task=record.task,
        system=system,
        metadata={**record.metadata, "answer_a": a, "answer_b": b, "judge_mode": "pairwise", "verdict": verdict},
    )


def judgment_as_prompt(record: JudgmentRecord) -> PromptRecord:
    """A judgment record as an RL prompt (judge RL): the judge prompt, its images and system turn, and the
    target's verdict (the content of its last ``<answer>`` tag) as the reference answer, with the
    verdict words (``A``/``B``/``tie`` or ``yes``/``no``) as its ``vocabulary``."""
    found = re.findall(r"<answer>(.*?)</answer>", record.target, re.DOTALL | re.IGNORECASE)
    if not found or not found[-1].strip():
        raise ValueError(f"judgment record {record.id!r}: target {record.target[:80]!r} has no <answer> verdict")
    verdict = found[-1].strip()
    mode = record.metadata.get("judge_mode") or ("pointwise" if verdict.lower() in ("yes", "no") else "pairwise")
    vocab = ["A", "B", "tie"] if mode == "pairwise" else ["yes", "no"]
    return PromptRecord(
        id=record.id,
        prompt=record.prompt,
        images=list(record.images),
        videos=list(record.videos),
        answer=verdict,
        task=record.task,
        system=record.system,
        metadata={**record.metadata, "judge_mode": mode, "vocabulary": vocab, "ground_truth": verdict},
    )
