"""Reward servers for the tests of sources behind HTTP (test_reward_http.py, test_reward_openai_judge.py):
``vlrft serve-reward-model`` in its own process (:class:`Served`), a real aiohttp server in a thread of the test
process (:class:`LocalServer`), and the samples and source configs they score."""

from __future__ import annotations

import asyncio
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from launch import subprocess_env

from data_pipelines.synthetic import make_prompt_records
from reward_models.kinds import check_source
from reward_models.kinds import source_config as RewardSourceConfig  # flat keys -> the kind's config

REPO = Path(__file__).resolve().parents[1]


class Served:
    """``python -m vlrft serve-reward-model ITEMS --port 0``, its URL read from the line it prints."""

    def __init__(self, *items: str, args: tuple[str, ...] = (), expect_host: str = "127.0.0.1"):
        command = [sys.executable, "-m", "vlrft", "serve-reward-model", *items, "--port", "0", "--device", "cpu"]
        self.proc = subprocess.Popen(
            [*command, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=subprocess_env(),
            cwd=REPO,
            start_new_session=True,
        )
        line = self._line(deadline=time.monotonic() + 300)
        found = re.fullmatch(rf"serving reward source '(.+)' \((\w+)\) on (http://{re.escape(expect_host)}:\d+)", line)
        assert found, (line, self.proc.stderr.read().decode() if self.proc.poll() is not None else "")
        self.name, self.kind, self.url = found.groups()

    def _line(self, deadline: float) -> str:
        fd, buf = self.proc.stdout.fileno(), b""
        while b"\n" not in buf and time.monotonic() < deadline:
            if select.select([fd], [], [], 1.0)[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                buf += chunk
        return buf.decode().strip()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()


class LocalServer:
    """A real aiohttp server on 127.0.0.1 in a thread of the test process, recording what it received."""

    def __init__(self, routes: list[web.RouteDef]):
        self.received: list[dict] = []
        self.headers: list[dict] = []
        self.ready = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self._main(routes),), daemon=True)
        self.thread.start()
        assert self.ready.wait(30)

    async def _main(self, routes: list[web.RouteDef]) -> None:
        app = web.Application()
        app.add_routes(routes)
        runner = web.AppRunner(app, shutdown_timeout=0.5)  # a hanging handler is not waited for
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.loop, self.stopped = asyncio.get_running_loop(), asyncio.Event()
        self.ready.set()
        await self.stopped.wait()
        await runner.cleanup()

    async def record(self, request: web.Request) -> dict:
        body = await request.json()
        self.received.append(body)
        self.headers.append(request.headers.copy())
        return body

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stopped.set)
        self.thread.join(10)


def colour_samples(n_prompts: int = 3, seed: int = 5):
    """Responses to synthetic colour records (each with its PIL image): right, wrong and rambling."""
    records = make_prompt_records("color", n_prompts, seed=seed)
    per = ["red", "green", "it is blue I think", "yellow"]
    rows = [r for r in records for _ in per]
    responses = [p for _ in records for p in per]
    return rows, responses


def source_cfg(**fields) -> RewardSourceConfig:
    """A source's config, checked as the pool checks ``reward.sources[0]``."""
    cfg = RewardSourceConfig(**fields)
    check_source(cfg, "reward.sources[0]")
    return cfg


def vllm_serve(model: Path, log: Any, name: str) -> tuple[subprocess.Popen, str | None]:
    """vLLM's OpenAI-compatible server of ``model`` served as ``name`` on a free port, as docs/reward-models.md starts
    it (on CPU, float32, eager, a 256 MiB KV cache; vlrft's vLLM plugin gives it the image-only processor in each of
    its processes): (the process, its URL) once ``/v1/models`` answers (None if it never does, within 10 minutes)."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(model)]
    command += ["--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    command += ["--enforce-eager", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 * 2**20)]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=subprocess_env(), start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(2)
    return proc, None
