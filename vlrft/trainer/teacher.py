"""The teacher of on-policy distillation (``teacher:`` of ``vlrft train-policy``; docs/distillation.md).

The student (the policy) samples; the teacher computes the log-prob of every token the student sampled, on the
student's own token sequence (prompt with its images, response), in one forward per micro-batch; the trainer turns
``log pi_T - log pi_S`` into per-token rewards (:func:`vlrft.algorithms.distillation_rewards`): the advantage itself
with ``algorithm.advantage_estimator: opd``, or added (times ``teacher.coef``) to another estimator's advantages.
Only the policy's own tokens count (a trajectory's tool observations are outside the response mask).

The teacher is loaded like a reward model: once, frozen, computing like the policy's strategy, and with
``teacher.offload`` moved to the device only while it scores (:class:`~vlrft.models.offload.Offloadable`). Before
any weight is read, :func:`check_teacher` refuses a teacher whose tokenizer maps the student's vocabulary otherwise
(one line naming the first differing token and the two tokenizer files) or whose image processor would cut the
student's images into other patches, and reports a chat template that differs (the teacher reads the student's
tokens as the student's template formatted them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from data_pipelines.collate import tokenizer_of
from vlrft.config import ConfigError, option
from vlrft.models.loading import load_model, load_processor, resolve_model_path
from vlrft.models.offload import Offloadable
from vlrft.trainer.experience import infer_response_logprobs


@dataclass
class TeacherConfig:
    """On-policy distillation: a teacher model scores every token the policy sampled (docs/distillation.md)."""

    path: str = option(
        "", "teacher model folder or hub id, the same tokenizer as the policy (empty: no teacher, no distillation)"
    )
    coef: float = option(
        1.0,
        "weight of the distillation term log pi_teacher - log pi_policy per token (advantage_estimator opd: the "
        "advantage; another estimator: added to its advantages)",
        ge=0,
    )
    micro_batch_size: int = option(16, "samples per teacher forward", ge=1)
    offload: bool = option(True, "keep the teacher in CPU memory except while it scores")
    dtype: str = option("", "the teacher's dtype (empty: the policy's model.dtype)")

    @property
    def enabled(self) -> bool:
        return bool(self.path)


# what must agree for the teacher to read the student's image tokens as the student's processor made them
_IMAGE_KEYS = ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels")


def _tokenizer_file(path: str) -> str:
    folder = Path(resolve_model_path(path))
    for name in ("tokenizer.json", "vocab.json"):
        if (folder / name).is_file():
            return str(folder / name)
    return str(folder)


def check_teacher(teacher_path: str, student_path: str, log: Callable[[str], None] = print) -> None:
    """Refuse (one :class:`ConfigError` line) a teacher that cannot score the student's tokens: another vocabulary
    (the first token the two tokenizers map differently, with both files), or another image patching; report a chat
    template that differs. Reads tokenizers and processor configs only, no weights."""
    key = f"teacher.path={teacher_path}"
    t_proc, s_proc = load_processor(teacher_path), load_processor(student_path)
    t_tok, s_tok = tokenizer_of(t_proc), tokenizer_of(s_proc)
    t_vocab, s_vocab = t_tok.get_vocab(), s_tok.get_vocab()
    for token, index in sorted(s_vocab.items(), key=lambda kv: kv[1]):
        if t_vocab.get(token) != index:
            theirs = "does not have it" if token not in t_vocab else f"maps it to {t_vocab[token]}"
            raise ConfigError(
                f"{key}: the teacher's tokenizer ({_tokenizer_file(teacher_path)}) {theirs}, the policy's "
                f"({_tokenizer_file(student_path)}) maps {token!r} to {index}; on-policy distillation needs one "
                "vocabulary (the teacher scores the policy's token ids)"
            )
    s_image, t_image = getattr(s_proc, "image_processor", None), getattr(t_proc, "image_processor", None)
    if s_image is not None:
        if t_image is None:
            raise ConfigError(f"{key}: the teacher is text-only and the policy reads images; use a vision teacher")
        for name in _IMAGE_KEYS:
            mine, theirs = getattr(s_image, name, None), getattr(t_image, name, None)
            if mine != theirs:
                raise ConfigError(
                    f"{key}: the teacher's image processor has {name}={theirs}, the policy's {name}={mine}; the "
                    "teacher reads the policy's image tokens, so both must cut images alike"
                )
    if (getattr(t_proc, "chat_template", None) or t_tok.chat_template) != (
        getattr(s_proc, "chat_template", None) or s_tok.chat_template
    ):
        log(
            f"note: {key}: its chat template differs from the policy's; the teacher scores the policy's tokens as "
            "the policy's template formatted them"
        )


class Teacher(Offloadable):
    """A frozen teacher: :meth:`log_probs` of the responses of a collated batch, on the student's tokens."""

    def __init__(self, cfg: TeacherConfig, policy_dtype: str, device: torch.device, prepare: Callable[[Any], Any]):
        self.cfg, self.device, self.offload = cfg, device, cfg.offload
        model, _ = load_model(cfg.path, cfg.dtype or policy_dtype)
        self.model = prepare(model.eval().requires_grad_(False))
        self.init_residency()
        self.seconds = 0.0  # time spent scoring, since the last :meth:`take_seconds`

    def log_probs(self, batch: dict[str, torch.Tensor], response_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``[N, R]`` log-probs of ``response_ids`` under the teacher at temperature 1 (its own distribution, the one
        the student is distilled to), float32 on CPU, zeros past each response (``kwargs``: ``shared``,
        ``suppress`` as for the policy's log-probs)."""
        t0 = time.perf_counter()
        batch = {k: v for k, v in batch.items() if k != "routing"}  # the policy's experts, not the teacher's
        with self.on_device():
            out = infer_response_logprobs(
                self.model, batch, response_ids, micro_batch_size=self.cfg.micro_batch_size, temperature=1.0, **kwargs
            )
        self.seconds += time.perf_counter() - t0
        return out

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def distillation_metrics(
    teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor, seconds: float
) -> dict[str, float]:
    """``distill/reverse_kl``: the mean over sampled tokens of ``log pi_S - log pi_T`` (the per-token reverse KL's
    single-sample estimate, >= 0 in expectation, 0 when the student is the teacher); ``distill/teacher_logp`` and
    ``distill/student_logp``: the mean log-probs of the sampled tokens under each; ``time/teacher``."""
    m = mask.bool()
    if not m.any():
        return {"time/teacher": seconds}
    t, s = teacher_logp[m].double(), student_logp[m].double()
    return {
        "distill/reverse_kl": float((s - t).mean()),
        "distill/teacher_logp": float(t.mean()),
        "distill/student_logp": float(s.mean()),
        "time/teacher": seconds,
    }
