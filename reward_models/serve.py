"""``vlrft serve-reward-model``: any reward source (the config of a kind: verifier, srm, grm, function, ...)
served over HTTP, for ``kind: http`` sources on other machines (wire format: ``reward_models.remote``).

Requests that arrive within ``batch_window_ms`` of each other are scored together: their samples, in arrival
order, go to the source in calls of at most ``max_batch_size`` samples, one call at a time (a source holding a
model keeps it on its device between calls). Each reply holds its own samples' values and failures, and its
share (by sample count) of the extras of the calls that scored them, so that counts add up across requests.
A sample whose image cannot be decoded fails alone, with the reason; a request that is not the wire format
is answered 400 with one line naming the field. Replies are strict JSON (a non-finite reward: null, and that
sample failed with the reason). ``/health`` says which record fields the source needs (``needs``), for the
client's preflight.

Exposure: by default it listens on loopback, reads images sent inline only (data URIs; a path on the server's disk
only under ``--image-root``), takes bodies up to 256 MiB, decodes images only for a source that reads them and
then at most 100 million pixels a request, and closes a connection that sends nothing for 30 s (the bounds:
``reward_models.serve_requests``). ``api_key`` (``--api-key-env NAME``: the key in that environment variable,
never on the command line) makes ``/score`` and ``/verify`` answer 401 without ``Authorization: Bearer KEY``;
``/health`` stays open (it says ``auth: true``, so a client without a key stops at preflight) and checks a key
when one is sent.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hmac
import json
import os
import signal
import socket
import sys
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web

from reward_models.kinds import SOURCE_CONFIG, check_source, make_source
from reward_models.pool import _all_failed
from reward_models.remote import result_json, scores_json
from reward_models.samples import Sample
from reward_models.serve_requests import Limits, read_samples
from reward_models.sources import RewardSource, RewardSourceConfig, Scores, VerifierSourceConfig
from vlrft.config import option
from vlrft.errors import KnownError


@dataclass
class ServeConfig:
    """What ``vlrft serve-reward-model`` serves: one reward source (the host, port and batching are options)."""

    source: Any = option(
        VerifierSourceConfig(), "the served reward source, with the keys of its kind", union=SOURCE_CONFIG
    )


@dataclass
class _Pending:
    samples: list[Sample]
    done: asyncio.Future
    values: list[float] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    extras: dict[str, float] = field(default_factory=dict)


class RewardServer:
    """The aiohttp application around one source (:meth:`app`), with its batching queue; it builds the source of
    ``cfg`` on ``device`` (:func:`build_source`) with its threads, and reads requests within ``limits``."""

    def __init__(
        self,
        cfg: RewardSourceConfig,
        device: str,
        max_batch_size: int,
        batch_window_s: float,
        num_threads: int = 4,
        *,
        api_key: str = "",
        limits: Limits = Limits(),
    ):
        self.max_batch_size, self.batch_window_s = max_batch_size, batch_window_s
        self.api_key, self.limits = api_key, limits
        self.scorer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="score")  # one call at a time
        self.threads = ThreadPoolExecutor(max_workers=max(1, num_threads), thread_name_prefix="serve")
        # verifier sources check samples concurrently on the server's threads, as in the pool
        self.source: RewardSource = build_source(cfg, device, self.threads)
        self.grader = self.source.verifier()
        self.needs = sorted(type(self.source).needs(cfg))  # the record fields it reads (/health)
        self.queue: asyncio.Queue[_Pending] | None = None
        self.n_requests = self.n_calls = 0  # /score requests and source.score calls (batching merges requests)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_bytes, middlewares=[self._auth])
        app.router.add_get("/health", self.health)
        app.router.add_post("/score", self.score)
        app.router.add_post("/verify", self.verify)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.queue = asyncio.Queue()
        app["batcher"] = asyncio.create_task(self._batches())

    async def _stop(self, app: web.Application) -> None:
        app["batcher"].cancel()
        self.scorer.shutdown(wait=True)
        self.threads.shutdown(wait=True)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """With an API key: ``/score`` and ``/verify`` need it; ``/health`` checks one that is sent."""
        given = request.headers.get("Authorization")
        if self.api_key and (request.path != "/health" or given is not None):
            if not hmac.compare_digest((given or "").encode(), f"Bearer {self.api_key}".encode()):
                what = "a wrong API key" if given else "no API key"
                raise web.HTTPUnauthorized(text=f"{what}: this server wants 'Authorization: Bearer KEY'")
        return await handler(request)

    async def health(self, request: web.Request) -> web.Response:
        src = self.source
        return _json_response(
            {
                "name": src.name,
                "kind": src.kind,
                "holds_model": src.holds_model,
                "grades": self.grader is not None,
                "needs": self.needs,
                "requests": self.n_requests,
                "calls": self.n_calls,
                "auth": bool(self.api_key),
            }
        )

    async def _samples(self, request: web.Request) -> tuple[list[Sample | None], dict[int, str]]:
        """The request's samples (None where one failed to decode, with why), or a 4xx reply."""
        return await read_samples(request, self.limits, type(self.source).reads_images, self.threads)

    async def score(self, request: web.Request) -> web.Response:
        self.n_requests += 1
        samples, failed = await self._samples(request)
        ok = [i for i, s in enumerate(samples) if s is not None]
        pending = _Pending([samples[i] for i in ok], asyncio.get_running_loop().create_future())
        if ok:
            await self.queue.put(pending)
            await pending.done
        values = [0.0] * len(samples)
        for j, i in enumerate(ok):
            values[i] = pending.values[j]
        failed.update({ok[j]: why for j, why in pending.failed.items()})
        return _json_response(scores_json(Scores(torch.tensor(values), failed, pending.extras)))

    async def verify(self, request: web.Request) -> web.Response:
        if self.grader is None:
            raise web.HTTPNotFound(text=f"source {self.source.name!r} ({self.source.kind}) does not grade on its own")
        samples, failed = await self._samples(request)
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(
            *(loop.run_in_executor(self.threads, self._verify, s) for s in samples if s is not None)
        )
        it = iter(results)
        return _json_response(
            {"results": [{"exception": failed[i]} if s is None else next(it) for i, s in enumerate(samples)]}
        )

    def _verify(self, s: Sample) -> dict[str, Any]:
        try:
            result = self.grader(s.response, s.answer, **s.metadata)
        except Exception as exc:  # noqa: BLE001 - the client raises it, as the verifier would in-process
            return {"exception": f"{type(exc).__name__}: {exc}"}
        return result_json(result, self.grader.vote_key(result.extracted))

    async def _batches(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            group = [await self.queue.get()]
            n, deadline = len(group[0].samples), loop.time() + self.batch_window_s
            while n < self.max_batch_size and (left := deadline - loop.time()) > 0:
                try:
                    group.append(await asyncio.wait_for(self.queue.get(), left))
                except asyncio.TimeoutError:
                    break
                n += len(group[-1].samples)
            try:
                await self._score_group(group, loop)
            except Exception as exc:  # noqa: BLE001 - a bug here must not leave requests waiting forever
                for p in group:
                    if not p.done.done():
                        p.done.set_exception(exc)

    async def _score_group(self, group: list[_Pending], loop: asyncio.AbstractEventLoop) -> None:
        owners = [(p, j) for p in group for j in range(len(p.samples))]
        for p in group:
            p.values = [0.0] * len(p.samples)
        for start in range(0, len(owners), self.max_batch_size):
            call = owners[start : start + self.max_batch_size]
            scores = await loop.run_in_executor(self.scorer, self._call, [p.samples[j] for p, j in call])
            values = scores.values.detach().float().cpu().reshape(-1).tolist()
            if len(values) != len(call):  # the pool's rule: a wrong count fails the call
                scores = _all_failed(len(call), ValueError(f"returned {len(values)} values for {len(call)} samples"))
                values = [0.0] * len(call)
            for k, (p, j) in enumerate(call):
                p.values[j] = values[k]
                if k in scores.failed:
                    p.failed[j] = scores.failed[k]
            for p in group:  # each request's share of the call's extras
                share = sum(1 for q, _ in call if q is p) / len(call)
                if share:
                    for name, v in scores.extras.items():
                        p.extras[name] = p.extras.get(name, 0.0) + float(v) * share
        for p in group:
            p.done.set_result(None)

    def _call(self, samples: list[Sample]) -> Scores:
        self.n_calls += 1
        try:
            return self.source.score(samples)
        except Exception as exc:  # noqa: BLE001 - every sample of the call failed, with why
            return _all_failed(len(samples), exc)

    def close(self) -> None:
        self.source.close()


def _json_response(data: Any) -> web.Response:
    """A reply in strict JSON: a NaN or Infinity left in ``data`` is a bug here (500), never a reply that strict
    parsers refuse (``scores_json`` and ``result_json`` send non-finite values as null or 0, with the reason)."""
    return web.json_response(data, dumps=functools.partial(json.dumps, allow_nan=False))


def build_source(cfg: RewardSourceConfig, device: str, executor: Executor | None = None) -> RewardSource:
    """The served source, loaded (on ``device``: auto is cuda when there is one) and resident there, scoring on
    ``executor``'s threads when its kind scores samples concurrently."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not cfg.name:
        cfg.name = (cfg.verifier if isinstance(cfg, VerifierSourceConfig) else "") or cfg.kind
    check_source(cfg, "source")
    return make_source(cfg, torch.device(device), False, executor)


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (0: any free port), taken before the source loads; a
    :class:`KnownError` naming the address and why when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)  # (create_server's error loses the reason)
    except socket.gaierror as exc:  # a name that does not resolve
        why = f"--host {host}: cannot listen there: {exc.strerror} (want an address or a name of this machine)"
        raise KnownError(why) from None
    try:
        return socket.create_server((host, port), family=family, reuse_port=False)
    except OSError as exc:
        hint = {
            errno.EADDRINUSE: "another process listens there; --port 0 takes any free port",
            errno.EADDRNOTAVAIL: "not an address of this machine",
            errno.EACCES: "ports below 1024 need privileges",
        }.get(exc.errno, "")
        why = f"cannot listen on {host}:{port}: {os.strerror(exc.errno) if exc.errno else exc}"
        raise KnownError(why + (f" ({hint})" if hint else "")) from None


def serve(server: RewardServer, sock: socket.socket) -> None:
    """Serve on ``sock`` (:func:`listen`), print where, and serve until SIGTERM or SIGINT."""
    asyncio.run(_serve(server, sock))


async def _serve(server: RewardServer, sock: socket.socket) -> None:
    # an idle connection, or one whose headers are not complete, is closed after the read timeout (a body that
    # stops arriving: reward_models.serve_requests)
    keepalive = server.limits.read_timeout_s
    runner = web.AppRunner(server.app(), handle_signals=False, access_log=None, keepalive_timeout=keepalive)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    host, port = sock.getsockname()[:2]
    where = f"[{host}]" if ":" in host else host
    src = server.source
    print(f"serving reward source {src.name!r} ({src.kind}) on http://{where}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("stopping", file=sys.stderr, flush=True)
    await runner.cleanup()
