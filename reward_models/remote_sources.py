"""Reward sources on another machine: ``kind: http`` (any source served by ``vlrft serve-reward-model``) and
``kind: openai_judge`` (a judge model behind an OpenAI-compatible chat server, e.g. ``vllm serve``).

    reward:
      sources:
        - {name: rm, kind: http, url: "http://10.0.0.5:8100", fallback: 0.0}
        - {name: judge, kind: openai_judge, url: "http://10.0.0.6:8000", model: my-judge, api_key_env: JUDGE_KEY}

Both send their requests through one :class:`~reward_models.remote.HttpClient` (``timeout_s`` per try,
``max_retries`` with exponential backoff, ``max_concurrency`` in flight). A request that fails for good (a
timeout, a refused connection, a 5xx or 4xx reply, a malformed reply) fails the samples it carried, with
the URL and what happened; the pool then gives the source's ``fallback`` and counts them, or stops the run
(``reward_models.pool``). Failed requests are counted in the extras ``errors`` and ``timeouts``.

``http`` sends ``http_batch_size`` samples per request, images inline as PNG data URIs, and takes the served
source's :class:`~reward_models.sources.Scores` as they are (its failed samples and extras too). It asks the
server's ``/health`` in preflight, for the record fields the served source needs (``needs``: checked in every
record, as for a source in-process), and when it starts (a server that does not answer stops the run before
training, as a :class:`~reward_models.sources.RewardSourceError`), and grades responses on its own
(``verifier()``) when the served source does, through ``/verify``.

``openai_judge`` asks for one greedy chat completion per sample: the judge prompt of the ``grm`` kind (the
system turn ``judge_system_prompt``, the user turn ``judge_template`` with the record's images at its
``<image>`` placeholders, as ``image_url`` data URIs) and the verdict read by the ``grm`` kind's parser
(``unparsable_reward`` for a judgment it cannot read, counted in ``unparsable``). Pointwise only.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from data_pipelines.formatting import judgment_prompt, user_content
from data_pipelines.images import load_image, png_data_uri
from reward_models.generative import JudgmentParser
from reward_models.remote import HttpClient, Reply, check_url, result_from_json, sample_json, scores_from_json
from reward_models.samples import Sample
from reward_models.sources import (
    KIND_HELP,
    JudgeTextConfig,
    RewardSource,
    RewardSourceConfig,
    RewardSourceError,
    Scores,
    SourceContext,
    source_kind,
)
from reward_models.verifiers import Verifier, VerifierResult
from vlrft.config import ConfigError, option


@dataclass
class RemoteSourceConfig(RewardSourceConfig):
    """The keys of the kinds on another machine (http, openai_judge)."""

    url: str = option(
        "", "http: the reward server (vlrft serve-reward-model); openai_judge: the chat server's base URL"
    )
    api_key_env: str = option(
        "", "environment variable holding the server's API key, sent as Bearer token (empty: none)"
    )
    timeout_s: float = option(30.0, "time limit of one HTTP request", gt=0)
    max_retries: int = option(3, "retries of a failed request (exponential backoff)", ge=0)
    max_concurrency: int = option(4, "requests in flight at once", ge=1)


@dataclass
class HttpSourceConfig(RemoteSourceConfig):
    """A source served by vlrft serve-reward-model on another machine."""

    kind: str = option("http", KIND_HELP)
    http_batch_size: int = option(64, "samples per request", ge=1)


@dataclass
class OpenAIJudgeSourceConfig(RemoteSourceConfig, JudgeTextConfig):
    """A pointwise judge behind an OpenAI-compatible chat server."""

    kind: str = option("openai_judge", KIND_HELP)
    model: str = option("", "the judge model's name on the server")


class RemoteSource(RewardSource):
    """What the remote kinds share: the client, requests in parallel, a failed request failing its samples.
    A kind says how samples are grouped into requests (:meth:`_chunks`), what a request holds
    (:meth:`_request`) and what its reply scores (:meth:`_send`)."""

    def __init__(self, cfg: RemoteSourceConfig, context: SourceContext):
        super().__init__(cfg, context)
        self.url = cfg.url.rstrip("/")
        self.client = HttpClient(cfg.timeout_s, cfg.max_retries, cfg.max_concurrency, auth_headers(cfg))

    @classmethod
    def check(cls, cfg: Any, key: str) -> None:
        why = check_url(cfg.url, f"{key}.url")
        if why:
            raise ConfigError(why)
        if cfg.api_key_env and not os.environ.get(cfg.api_key_env):
            raise ConfigError(f"{key}.api_key_env={cfg.api_key_env}: the environment variable is not set")

    @classmethod
    def describe(cls, cfg: Any) -> str:
        return f"{cls.kind} {cfg.url}"

    def _chunks(self, n: int) -> list[list[int]]:
        raise NotImplementedError

    def _request(self, batch: list[Sample], uris: dict[int, str]) -> Any:
        raise NotImplementedError

    def _send(self, request: Any, n: int) -> Scores | Reply:
        """The scores of a request of ``n`` samples, or the failed :class:`Reply`."""
        raise NotImplementedError

    def score(self, samples: list[Sample]) -> Scores:
        uris: dict[int, str] = {}  # images encoded once per call (the responses of a prompt share them)
        chunks = self._chunks(len(samples))
        requests = [self._request([samples[i] for i in idx], uris) for idx in chunks]
        replies = self.client.map(lambda job: self._send(*job), [(r, len(idx)) for r, idx in zip(requests, chunks)])
        values, failed = torch.zeros(len(samples)), {}
        extras = {"errors": 0.0, "timeouts": 0.0}
        for idx, got in zip(chunks, replies):
            if isinstance(got, Reply):
                extras["timeouts" if got.timeout else "errors"] += 1
                failed.update({i: got.error for i in idx})
                continue
            values[idx] = got.values
            failed.update({idx[j]: why for j, why in got.failed.items()})
            for k, v in got.extras.items():  # counts (a served source's own errors, unparsable) add up
                extras[k] = extras.get(k, 0.0) + v
        return Scores(values, failed, extras)

    def close(self) -> None:
        self.client.close()


@source_kind(HttpSourceConfig)
class HttpSource(RemoteSource):
    """A reward source served by ``vlrft serve-reward-model`` (see the module doc)."""

    def __init__(self, cfg: HttpSourceConfig, context: SourceContext):
        super().__init__(cfg, context)
        try:
            self.health = served_health(self.client, self.url, cfg.name)
        except RewardSourceError:
            self.client.close()
            raise
        self.unavailable = ""  # why the server's last request went unanswered ("" once one is answered)

    @classmethod
    def needs(cls, cfg: Any) -> set[str]:
        """The record fields the served source reads, as the server's ``/health`` says (preflight checks them in
        every record; a server that does not answer stops the run here, before anything loads)."""
        client = HttpClient(cfg.timeout_s, cfg.max_retries, 1, auth_headers(cfg))
        try:
            return set(served_health(client, cfg.url.rstrip("/"), cfg.name).get("needs", []))
        finally:
            client.close()

    def _chunks(self, n: int) -> list[list[int]]:
        size = self.cfg.http_batch_size
        return [list(range(start, min(n, start + size))) for start in range(0, n, size)]

    def _request(self, batch: list[Sample], uris: dict[int, str]) -> dict[str, Any]:
        return {"samples": [sample_json(s, uris) for s in batch]}

    def _send(self, request: dict[str, Any], n: int) -> Scores | Reply:
        url = f"{self.url}/score"
        reply = self.client.request("POST", url, request)
        self.unavailable = reply.error if reply.unavailable else ""
        if reply.error:
            return reply
        try:
            scores = scores_from_json(reply.data, n)
        except ValueError as exc:
            return Reply(error=f"{url}: malformed reply: {exc}")
        scores.failed = {i: f"{url}: {why}" for i, why in scores.failed.items()}
        return scores

    def verifier(self) -> Verifier | None:
        return HttpVerifier(self) if self.health["grades"] else None


def auth_headers(cfg: Any) -> dict[str, str]:
    """``Authorization: Bearer KEY`` with the key in the environment variable ``cfg.api_key_env`` (none when empty):
    ``vlrft serve-reward-model --api-key-env`` and OpenAI-compatible servers (``vllm serve --api-key``) take it."""
    key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""
    return {"authorization": f"Bearer {key}"} if key else {}


def served_health(client: HttpClient, url: str, name: str) -> dict[str, Any]:
    """The reward server's ``/health`` at ``url``; :class:`RewardSourceError` when it is not there or not one
    (``needs``, when given, must be a list of field names)."""
    reply = client.request("GET", f"{url}/health")
    health, why = reply.data, reply.error
    if not why and (not isinstance(health, dict) or not {"name", "kind", "grades"} <= set(health)):
        why = f"{url}/health: not a reward server's reply: {str(health)[:120]}"
    if not why:
        needs = health.get("needs", [])
        if not isinstance(needs, list) or not all(isinstance(f, str) for f in needs):
            why = f"{url}/health: 'needs' must be a list of record field names, got {str(needs)[:120]}"
    if why:
        hint = "set the source's api_key_env" if "HTTP 401" in why else "is vlrft serve-reward-model running there?"
        raise RewardSourceError(f"reward source {name!r} (http): {why}; {hint}")
    if health.get("auth") and "authorization" not in client.http.headers:
        raise RewardSourceError(
            f"reward source {name!r} (http): {url} requires an API key (it was started with --api-key-env); "
            "set the source's api_key_env to the name of an environment variable holding it"
        )
    return health


class HttpVerifier(Verifier):
    """The served source's own verifier, asked through ``/verify`` (the held-out accuracy, the collapse detectors,
    ``vlrft eval``): its results as they are, and the vote keys (maj@k) it gave. A request that fails scores 0
    with the reason as ``error``; while the server's last request went unanswered none is sent (one sample at a
    time, each with its retries, would stall a step for minutes): the next ``/score`` of the pool asks again.
    The served verifier's ``ValueError`` (e.g. a record without an answer) is raised here too."""

    needs_answer = False
    # the collapse detectors read the response itself rather than ask the server once per sample per step
    extracts = False

    def __init__(self, source: HttpSource):
        super().__init__()
        self.source, self.name = source, source.url
        self._vote_keys: dict[str, str | None] = {}

    def check(self, response: str, answer: str | None, **metadata) -> VerifierResult:
        url = f"{self.source.url}/verify"
        if self.source.unavailable:
            return VerifierResult(0.0, None, False, False, error=f"not asked: {self.source.unavailable}")
        sample = Sample(id=str(metadata.get("id", "")), prompt=str(metadata.get("prompt", "")), response=response)
        sample.answer, sample.metadata = answer, metadata
        reply = self.source.client.request("POST", url, {"samples": [sample_json(sample)]})
        self.source.unavailable = reply.error if reply.unavailable else ""
        if reply.error:
            return VerifierResult(0.0, None, False, False, error=reply.error)
        got = reply.data.get("results", [None])[0] if isinstance(reply.data, dict) else None
        if isinstance(got, dict) and "exception" in got:
            raise ValueError(f"{url}: {got['exception']}")
        try:
            result, vote_key = result_from_json(got)
        except ValueError as exc:
            return VerifierResult(0.0, None, False, False, error=f"{url}: malformed reply: {exc}")
        if result.extracted is not None:
            self._vote_keys[result.extracted] = vote_key
        return result

    def vote_key(self, extracted: str | None) -> str | None:
        return self._vote_keys.get(extracted, super().vote_key(extracted)) if extracted is not None else None


@source_kind(OpenAIJudgeSourceConfig)
class OpenAIJudgeSource(RemoteSource):
    """A pointwise judge behind an OpenAI-compatible ``/v1/chat/completions`` (see the module doc)."""

    def __init__(self, cfg: OpenAIJudgeSourceConfig, context: SourceContext):
        super().__init__(cfg, context)
        self.chat_url = chat_completions_url(self.url)
        self.system = cfg.judge_system_prompt or None
        self.parser = JudgmentParser("pointwise", cfg.unparsable_reward, cfg.score_max)
        self._parsing = threading.Lock()  # the parser counts; replies arrive on the client's threads

    @classmethod
    def check(cls, cfg: Any, key: str) -> None:
        super().check(cfg, key)
        if not cfg.model:
            raise ConfigError(f"{key}.model: empty; name the judge model as the server knows it (GET /v1/models)")
        if cfg.judge_mode != "pointwise":
            raise ConfigError(f"{key}.judge_mode={cfg.judge_mode}: an openai_judge judges pointwise only")

    @classmethod
    def describe(cls, cfg: Any) -> str:
        return f"openai_judge {cfg.model} at {cfg.url}"

    def _chunks(self, n: int) -> list[list[int]]:
        return [[i] for i in range(n)]  # a chat completion judges one conversation

    def _request(self, batch: list[Sample], uris: dict[int, str]) -> dict[str, Any]:
        (s,) = batch
        c = self.cfg
        text = judgment_prompt(s.prompt, s.response, c.judge_template)
        # images at stored size (the server's processor sizes them); placed as the grm kind places them
        images = [im if isinstance(im, Image.Image) else load_image(im, max_pixels=None) for im in s.images]
        content = []
        for item in user_content(text, images):
            if item["type"] == "text":
                content.append({"type": "text", "text": item["text"]})
                continue
            if id(item["image"]) not in uris:
                uris[id(item["image"])] = png_data_uri(item["image"])
            content.append({"type": "image_url", "image_url": {"url": uris[id(item["image"])]}})
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": content})
        return {"model": c.model, "messages": messages, "max_tokens": c.max_new_tokens, "temperature": 0.0}

    def _send(self, request: dict[str, Any], n: int) -> Scores | Reply:
        reply = self.client.request("POST", self.chat_url, request)
        if reply.error:
            return reply
        try:
            text = reply.data["choices"][0]["message"]["content"]
            if not isinstance(text, str):
                raise TypeError(f"content is {type(text).__name__}")
        except (KeyError, IndexError, TypeError) as exc:
            shown = str(reply.data)[:120]
            return Reply(error=f"{self.chat_url}: malformed reply (no choices[0].message.content: {exc}): {shown}")
        with self._parsing:
            before = self.parser.n_unparsable
            value = self.parser.reward(text)
            unparsable = float(self.parser.n_unparsable - before)
        return Scores(torch.tensor([value], dtype=torch.float32), extras={"unparsable": unparsable})


def chat_completions_url(url: str) -> str:
    """The chat endpoint of a server's base URL (``http://host:8000``, ``.../v1`` or the endpoint itself)."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")
