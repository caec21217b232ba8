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

import math
import os
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

import torch

from data_pipelines.collate import tokenizer_of
from reward_models.remote import HttpClient, Reply, check_url
from reward_models.remote_sources import auth_headers
from vlrft.config import ConfigError, check_range, option
from vlrft.errors import TeacherError
from vlrft.models.loading import load_model, load_processor, resolve_model_path
from vlrft.models.offload import Offloadable
from vlrft.trainer.experience import infer_response_logprobs, response_logits, samples_of_batch


@dataclass
class TeacherConfig:
    """On-policy distillation: a teacher model scores every token the policy sampled (docs/distillation.md)."""

    path: str = option(
        "", "teacher model folder or hub id, the same tokenizer as the policy (empty: no teacher, no distillation)"
    )
    url: str = option(
        "",
        "instead of path: the base URL of an OpenAI-compatible completions server of the teacher that returns prompt "
        "log-probs (vllm serve); token ids in, so text records only (docs/distillation.md#a-served-teacher)",
    )
    model: str = option("", "teacher.url: the served model's name (empty: the server's only model)")
    api_key_env: str = option(
        "", "teacher.url: environment variable holding the server's API key, sent as Bearer token (empty: none)"
    )
    timeout_s: float = option(60.0, "teacher.url: time limit of one request", gt=0)
    max_retries: int = option(3, "teacher.url: retries of a failed request (exponential backoff)", ge=0)
    max_concurrency: int = option(4, "teacher.url: requests in flight at once", ge=1)
    fallback: bool = option(
        False,
        "teacher.url: a sample the server fails to score gets no distillation term (its teacher log-probs are the "
        "policy's; counted in distill/teacher_failures) instead of stopping the run",
    )
    max_failure_share: float = option(
        0.5,
        "teacher.url: stop the run when more than this share of a step's samples fail, even with fallback",
        ge=0,
        le=1,
    )
    coef: float = option(
        1.0,
        "weight of the distillation term log pi_teacher - log pi_policy per token (advantage_estimator opd: the "
        "advantage; another estimator: added to its advantages)",
        ge=0,
    )
    per_token: str = option(
        "sampled",
        "the distillation term per token: sampled (log pi_T - log pi_S of the sampled token, through the policy "
        "gradient) or vocabulary (the exact reverse KL over the whole vocabulary at each sampled position, a loss "
        "term; one in-process teacher; docs/distillation.md#the-whole-vocabulary-teacherper_token-vocabulary)",
        choices=("sampled", "vocabulary"),
    )
    micro_batch_size: int = option(16, "samples per teacher forward (teacher.url: per request)", ge=1)
    offload: bool = option(True, "keep the teacher in CPU memory except while it scores")
    dtype: str = option("", "the teacher's dtype (empty: the policy's model.dtype)")
    by_name: dict = option(
        {},
        "several teachers: NAME -> {path: ... or url: ..., and any teacher key but coef and per_token}; a record's "
        "metadata.teacher names its teacher, one without it gets teacher.path / teacher.url "
        "(docs/distillation.md#several-teachers)",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.path or self.url or self.by_name)

    def named(self) -> dict[str, TeacherConfig]:
        """The teachers by name: ``""`` for ``teacher.path`` / ``teacher.url`` (when given), then ``by_name``'s, each
        with this section's keys under its own (call :meth:`check` first)."""
        out = {"": replace(self, by_name={})} if self.path or self.url else {}
        for name, entry in self.by_name.items():
            out[name] = self._entry(entry)
        return out

    def _entry(self, entry: dict) -> TeacherConfig:
        """A named teacher: this section's keys under the entry's own (its path or url, not this section's)."""
        return replace(self, **{"path": "", "url": "", **entry, "by_name": {}})

    def check(self, key: str = "teacher") -> None:
        """The keys alone (no server asked, no file read): one of path and url, a URL that is one, its key set; each
        of ``by_name`` likewise (a mapping of known keys, one of path and url)."""
        if self.path and self.url:
            raise ConfigError(
                f"{key}.path={self.path} and {key}.url={self.url}: give one (a model folder scored in-process, "
                "or a server)"
            )
        if self.url:
            why = check_url(self.url, f"{key}.url")
            if why:
                raise ConfigError(why)
            if self.api_key_env and not os.environ.get(self.api_key_env):
                raise ConfigError(f"{key}.api_key_env={self.api_key_env}: the environment variable is not set")
        if self.per_token == "vocabulary" and (self.url or self.by_name):
            raise ConfigError(
                f"{key}.per_token=vocabulary: needs one in-process teacher ({key}.path; a served teacher returns the "
                "sampled tokens' log-probs only, and several teachers are not one distribution per token)"
            )
        allowed = sorted(f.name for f in fields(self) if f.name not in ("coef", "by_name", "per_token"))
        for name, entry in self.by_name.items():
            where = f"{key}.by_name.{name}"
            if not isinstance(entry, dict):
                raise ConfigError(f"{where}={entry!r}: must be a mapping of teacher keys ({', '.join(allowed)})")
            unknown = sorted(set(entry) - set(allowed))
            if unknown:
                raise ConfigError(
                    f"{where}.{unknown[0]}: not a key of a named teacher (these are: {', '.join(allowed)}; coef and "
                    "per_token are the section's, for every teacher)"
                )
            if not entry.get("path") and not entry.get("url"):
                raise ConfigError(f"{where}: needs path (a model folder) or url (a server)")
            for f in fields(self):
                if f.name in entry:
                    value, want = entry[f.name], type(f.default)
                    if not isinstance(value, want) and not (want is float and type(value) is int):
                        raise ConfigError(f"{where}.{f.name}={value!r}: must be a {want.__name__}")
                    check_range(f"{where}.{f.name}", value, f.metadata)
            self._entry(entry).check(where)


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
    """A frozen teacher: :meth:`log_probs` of the responses of a collated batch, on the student's tokens
    (``failed``: the samples of the last call it could not score, none in-process; see :class:`ServedTeacher`)."""

    failed: list[int] = []

    def __init__(self, cfg: TeacherConfig, policy_dtype: str, device: torch.device, prepare: Callable[[Any], Any]):
        self.cfg, self.device, self.offload = cfg, device, cfg.offload
        model, _ = load_model(cfg.path, cfg.dtype or policy_dtype)
        self.model = prepare(model.eval().requires_grad_(False))
        self.init_residency()
        self.seconds = 0.0  # time spent scoring, since the last :meth:`take_seconds`

    def log_probs(self, batch: dict[str, torch.Tensor], response_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``[N, R]`` log-probs of ``response_ids`` under the teacher at temperature 1 (its own distribution, the one
        the student is distilled to), float32 on CPU, meaningless past each response (masked there by the caller;
        ``kwargs``: ``shared``, ``suppress`` as for the policy's log-probs)."""
        t0 = time.perf_counter()
        batch = {k: v for k, v in batch.items() if k != "routing"}  # the policy's experts, not the teacher's
        with self.on_device():
            out = infer_response_logprobs(
                self.model, batch, response_ids, micro_batch_size=self.cfg.micro_batch_size, temperature=1.0, **kwargs
            )
        self.seconds += time.perf_counter() - t0
        return out

    @torch.no_grad()
    def vocabulary_log_probs(self, mb: dict[str, torch.Tensor], **kwargs: Any) -> torch.Tensor:
        """``[N, R, V]`` log-probs of the whole vocabulary at each response position of micro-batch ``mb`` under the
        teacher (temperature 1; ``kwargs``: ``shared``, ``suppress``), for ``teacher.per_token: vocabulary``: called
        in the update, one micro-batch at a time, on the device the policy computes on."""
        t0 = time.perf_counter()
        batch = {k: v for k, v in mb.items() if k != "routing"}  # the policy's experts, not the teacher's
        with self.on_device():  # the teacher's model is in eval mode from its load on
            logits = response_logits(self.model, batch, mb["response_ids"].shape[1], **kwargs)
            out = torch.log_softmax(logits.float(), dim=-1)
        self.seconds += time.perf_counter() - t0
        return out

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def close(self) -> None:
        """Nothing to release (the weights go with the object)."""


def make_teacher(cfg: Any, student_path: str, strategy: Any, log: Callable[[str], None]) -> Teachers:
    """The run's teachers (``cfg``: the policy run's config), each loaded once: in-process (``path``, computing like
    the policy's ``strategy``) or served (``url``, asked first by :func:`check_served_teacher`)."""
    made: dict[str, Teacher | ServedTeacher] = {}
    for name, t in cfg.teacher.named().items():
        if t.url:
            made[name] = ServedTeacher(t, check_served_teacher(t, student_path, cfg.sequence_length(), log), log)
        else:
            made[name] = Teacher(t, cfg.model.dtype, strategy.device, strategy.compute_like_policy)
    return Teachers(made)


class Teachers:
    """The run's teachers by name (``""``: ``teacher.path`` / ``teacher.url``; the others ``teacher.by_name``'s):
    :meth:`log_probs` gives each sample its record's teacher's log-probs (``names``: the records'
    ``metadata.teacher``, ``""`` for none), each teacher scoring only its own samples (whole groups: the samples of a
    record share its teacher, so a group's prompt is still computed once)."""

    def __init__(self, teachers: dict[str, Teacher | ServedTeacher]):
        self.teachers = teachers
        self.failed: list[int] = []  # the samples of the last call no teacher could score (served, with fallback)

    def log_probs(
        self, batch: dict[str, torch.Tensor], response_ids: torch.Tensor, names: list[str], **kwargs: Any
    ) -> torch.Tensor:
        for name in dict.fromkeys(names):
            if name not in self.teachers:
                have = ", ".join(repr(n) for n in self.teachers if n) or "none"
                raise TeacherError(
                    f"metadata.teacher={name!r}: no such teacher (teacher.by_name has {have})"
                    if name
                    else "a record names no teacher (metadata.teacher) and there is no teacher.path or teacher.url"
                )
        if len(set(names)) == 1:
            teacher = self.teachers[names[0]]
            out = teacher.log_probs(batch, response_ids, **kwargs)
            self.failed = list(teacher.failed)
            return out
        whole = samples_of_batch(batch, response_ids)  # its micro_batch(): a subset with its images and videos
        out = torch.zeros(response_ids.shape, dtype=torch.float32)
        self.failed = []
        for name in dict.fromkeys(names):
            idx = torch.tensor([i for i, x in enumerate(names) if x == name])
            part = whole.micro_batch(idx)
            teacher = self.teachers[name]
            got = teacher.log_probs(part, part["response_ids"], **kwargs)
            out[idx, : got.shape[1]] = got
            self.failed += [int(idx[k]) for k in teacher.failed]
        self.failed.sort()
        return out

    def take_seconds(self) -> float:
        return sum(t.take_seconds() for t in self.teachers.values())

    def close(self) -> None:
        for t in self.teachers.values():
            t.close()


def _client(cfg: TeacherConfig, max_concurrency: int | None = None) -> HttpClient:
    return HttpClient(cfg.timeout_s, cfg.max_retries, max_concurrency or cfg.max_concurrency, auth_headers(cfg))


def check_served_teacher(
    cfg: TeacherConfig, student_path: str, needed_len: int, log: Callable[[str], None] = print
) -> str:
    """Ask ``teacher.url`` before training, as preflight: it answers ``/v1/models`` and serves ``teacher.model`` (or
    one model, whose name is returned), its context holds ``needed_len`` tokens (a prompt and its response), and its
    ``/tokenize`` cuts a probe text (the policy's chat template around some words, and the policy's special tokens)
    into the ids the policy's tokenizer gives (a server without ``/tokenize``: a note, the vocabulary unchecked).
    One :class:`TeacherError` line otherwise, naming the URL, what it said and the rule."""
    url, key = cfg.url.rstrip("/"), f"teacher.url={cfg.url}"
    client = _client(cfg, 1)
    try:
        reply = client.request("GET", f"{url}/v1/models")
        if reply.error:
            raise TeacherError(f"{key}: the teacher server does not answer: {reply.error}")
        cards = reply.data.get("data") if isinstance(reply.data, dict) else None
        if not isinstance(cards, list) or not all(isinstance(c, dict) and "id" in c for c in cards):
            raise TeacherError(f"{key}: {url}/v1/models is no OpenAI model list (want {{'data': [{{'id': ...}}]}})")
        names = [str(c["id"]) for c in cards]
        if cfg.model and cfg.model not in names:
            raise TeacherError(f"{key}: serves {', '.join(names) or 'no model'}, not teacher.model={cfg.model}")
        if not cfg.model and len(names) != 1:
            raise TeacherError(f"{key}: serves {len(names)} models ({', '.join(names)}); name one with teacher.model")
        name = cfg.model or names[0]
        card = cards[names.index(name)]
        limit = card.get("max_model_len")
        if isinstance(limit, int) and limit < needed_len:
            raise TeacherError(
                f"{key}: its model {name} takes {limit} tokens (max_model_len), a prompt and its response here up to "
                f"{needed_len} (data.max_prompt_length + rollout.max_new_tokens); serve it with --max-model-len "
                f"{needed_len} or more"
            )
        tok = tokenizer_of(load_processor(student_path))
        probe = _vocabulary_probe(tok)
        mine = tok.encode(probe, add_special_tokens=False)
        reply = client.request("POST", f"{url}/tokenize", {"model": name, "prompt": probe, "add_special_tokens": False})
        if reply.error:
            log(
                f"note: {key}: its vocabulary could not be checked ({reply.error}); the teacher must map the "
                "policy's token ids as the policy's tokenizer does"
            )
            return name
        theirs = reply.data.get("tokens") if isinstance(reply.data, dict) else None
        if theirs != mine:
            if not isinstance(theirs, list):
                raise TeacherError(f"{key}: {url}/tokenize gave no token list (want {{'tokens': [...]}})")
            k = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            piece = tok.decode(mine[k : k + 1]) if k < len(mine) else "(the end of the text)"
            raise TeacherError(
                f"{key}: the served teacher's tokenizer gives {theirs[k] if k < len(theirs) else 'nothing'} at token "
                f"{k} of a probe text, the policy's ({_tokenizer_file(student_path)}) gives "
                f"{mine[k] if k < len(mine) else 'nothing'} ({piece!r}); on-policy distillation needs one vocabulary "
                "(the teacher scores the policy's token ids)"
            )
        return name
    finally:
        client.close()


def _vocabulary_probe(tok: Any) -> str:
    """A text whose ids test a vocabulary: the policy's chat template around words, digits and punctuation, then
    every special token the policy's tokenizer adds (the template's and the vision and tool marks)."""
    words = "The answer is 42, not 7.5; café résumé naïve \u4f60\u597d! <answer>red</answer>\n\tdone"
    conversation = [{"role": "user", "content": words}, {"role": "assistant", "content": words}]
    try:
        text = tok.apply_chat_template(conversation, tokenize=False)
    except (ValueError, AttributeError):  # no chat template
        text = words
    return text + "".join(tok.all_special_tokens) + "".join(getattr(tok, "added_tokens_encoder", {}))


class ServedTeacher:
    """On-policy distillation's teacher behind an OpenAI-compatible completions server (``teacher.url``, e.g.
    ``vllm serve``): each sample's token ids (the policy's prompt and response, as the policy's template formatted
    them) go as a token-id prompt with ``prompt_logprobs: 0``, ``teacher.micro_batch_size`` samples per request,
    ``max_concurrency`` requests in flight; the reply's log-prob of each response token is the teacher's, from the
    model's raw distribution (vLLM's default ``logprobs_mode``). Retries and timeouts as ``kind: http``
    (:class:`~reward_models.remote.HttpClient`). A sample the server fails to score (a request failed for good, a
    malformed reply, a sample with images: the completions API carries token ids only) is in :attr:`failed` with
    ``teacher.fallback`` (the trainer gives it no distillation term, counted) and stops the run otherwise, or when
    more than ``teacher.max_failure_share`` of a step's samples fail."""

    offload = False

    def __init__(self, cfg: TeacherConfig, model: str, log: Callable[[str], None] = print):
        self.cfg, self.model, self.log = cfg, model, log  # model: the served name (check_served_teacher's)
        self.url = f"{cfg.url.rstrip('/')}/v1/completions"
        self.client = _client(cfg)
        self.seconds = 0.0
        self.failed: list[int] = []

    def log_probs(self, batch: dict[str, torch.Tensor], response_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        """``[N, R]`` log-probs of ``response_ids`` under the served teacher, float32, zeros past each response and
        for the samples in :attr:`failed`."""
        t0 = time.perf_counter()
        n, width = response_ids.shape
        out = torch.zeros(n, width)
        why: dict[int, str] = {}
        jobs: list[tuple[int, list[int], int, int]] = []  # (sample, its ids, prompt length, response length)
        none = torch.zeros(n, dtype=torch.long)  # a sub-batch without images or videos has no counts of them
        media = batch.get("images_per_sample", none) + batch.get("videos_per_sample", none)
        for i in range(n):
            pl, rl = int(batch["prompt_lengths"][i]), int(batch["response_lengths"][i])
            if int(media[i]):
                why[i] = "the sample has images or videos, and the completions API takes token ids only"
            elif rl:
                jobs.append((i, batch["input_ids"][i, : pl + rl].tolist(), pl, rl))
        size = self.cfg.micro_batch_size
        chunks = [jobs[k : k + size] for k in range(0, len(jobs), size)]
        for chunk, got in zip(chunks, self.client.map(self._send, chunks)):
            if isinstance(got, Reply):
                why.update({job[0]: got.error for job in chunk})
                continue
            for job, values in zip(chunk, got):
                if isinstance(values, str):
                    why[job[0]] = f"{self.url}: malformed reply: {values}"
                else:
                    out[job[0], : job[3]] = values
        self.seconds += time.perf_counter() - t0
        self.failed = sorted(why)
        if why:
            first = why[self.failed[0]]
            share = len(why) / max(n, 1)
            if not self.cfg.fallback:
                raise TeacherError(
                    f"teacher.url={self.cfg.url}: {len(why)} of {n} samples unscored, the first: {first} (no fallback "
                    "set: teacher.fallback)"
                )
            if share > self.cfg.max_failure_share:
                raise TeacherError(
                    f"teacher.url={self.cfg.url}: {len(why)} of {n} samples unscored ({share:.0%}, more than "
                    f"teacher.max_failure_share={self.cfg.max_failure_share:g}), the first: {first}"
                )
            self.log(
                f"warning: teacher.url={self.cfg.url}: {len(why)} of {n} samples unscored, the first: {first}; they "
                "get no distillation term (counted in distill/teacher_failures)"
            )
        return out

    def _send(self, chunk: list[tuple[int, list[int], int, int]]) -> Reply | list[torch.Tensor | str]:
        """One request: the chunk's samples as token-id prompts; per sample its response log-probs or why not."""
        prompts = [ids for _, ids, _, _ in chunk]
        request = {"model": self.model, "prompt": prompts, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        reply = self.client.request("POST", self.url, request)
        if reply.error:
            return reply
        choices = reply.data.get("choices") if isinstance(reply.data, dict) else None
        if not isinstance(choices, list) or len(choices) != len(chunk):
            got = f"{len(choices)} choices" if isinstance(choices, list) else "no 'choices' list"
            return Reply(error=f"{self.url}: malformed reply: {got} for {len(chunk)} prompts")
        by_index = {c.get("index", k) if isinstance(c, dict) else k: c for k, c in enumerate(choices)}
        return [_response_logprobs(by_index.get(k), ids, pl, rl) for k, (_, ids, pl, rl) in enumerate(chunk)]

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def close(self) -> None:
        self.client.close()


def _response_logprobs(choice: Any, ids: list[int], pl: int, rl: int) -> torch.Tensor | str:
    """The log-probs of ``ids[pl : pl + rl]`` in a completion choice's ``prompt_logprobs`` (vLLM: one entry per
    prompt token, ``None`` for the first, else ``{token id: {"logprob": x, ...}}`` holding the prompt's own token),
    or why they are not there."""
    entries = choice.get("prompt_logprobs") if isinstance(choice, dict) else None
    if not isinstance(entries, list) or len(entries) != len(ids):
        got = f"{len(entries)} entries" if isinstance(entries, list) else "no 'prompt_logprobs' list"
        return f"{got} for a prompt of {len(ids)} tokens (a server that returns prompt log-probs: vllm serve)"
    values = []
    for t in range(pl, pl + rl):
        entry = entries[t] if isinstance(entries[t], dict) else {}
        found = entry.get(str(ids[t]), entry.get(ids[t]))
        value = found.get("logprob") if isinstance(found, dict) else found
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value > 1e-4:
            return f"token {t} (id {ids[t]}): no log-prob <= 0 for it ({str(entry)[:80]})"
        values.append(min(float(value), 0.0))
    return torch.tensor(values, dtype=torch.float32)


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
