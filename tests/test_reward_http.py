"""Reward models served over HTTP (issue 24, item 4): ``vlrft serve-reward-model`` serving a real tiny SRM and a
rule verifier in its own process, ``kind: http`` scoring through it exactly as the source does in-process (a
whole train-policy run ends bitwise equal), a server that dies, hangs or misbehaves giving the fallback (counted)
or one line naming the URL, in bounded time; and ``kind: openai_judge`` against an OpenAI-compatible chat server
(one written here with aiohttp, and ``vllm serve`` in the vllm suite)."""

from __future__ import annotations

import asyncio
import json
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

import httpx
import pytest
import torch
from aiohttp import web
from launch import subprocess_env
from safetensors.torch import load_file

from data_pipelines.formatting import JUDGE_SYSTEM_PROMPT, judgment_prompt
from data_pipelines.images import load_image
from data_pipelines.synthetic import make_prompt_records
from reward_models.generative import parse_judgment
from reward_models.pool import RewardPool, RewardPoolConfig, RewardSourceConfig, RewardSourceError
from reward_models.samples import samples_of
from reward_models.sources import check_source, make_source
from vlrft.cli import main
from vlrft.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
QUIET = ["logging.wandb=disabled", "logging.progress_bar=false", "logging.tensorboard=false"]
POLICY = [
    "data.synthetic_train_size=16",
    "data.synthetic_eval_size=4",
    "rollout.rollout_batch_size=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=4",
    "optim.lr=1e-3",
    "train.log_every=1",
]
ACC = "reward_pool/reward/accuracy"  # the pool's metrics of the source named accuracy, as train-policy logs them


# -- a reward server in its own process -------------------------------------------------------------
class Served:
    """``python -m vlrft serve-reward-model ITEMS --port 0``, its URL read from the line it prints."""

    def __init__(self, *items: str, args: tuple[str, ...] = ()):
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
        found = re.fullmatch(r"serving reward source '(.+)' \((\w+)\) on (http://127\.0\.0\.1:\d+)", line)
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


@pytest.fixture(scope="module")
def served_srm(srm_dir):
    server = Served("source.kind=srm", f"source.path={srm_dir}", "source.name=rm", "source.micro_batch_size=4")
    yield server
    server.kill()


@pytest.fixture(scope="module")
def served_verifier():
    server = Served("source.verifier=vocab_answer", args=("--batch-window-ms", "300"))
    yield server
    server.kill()


def _samples(n_prompts: int = 3, seed: int = 5):
    """Responses to synthetic colour records (each with its PIL image): right, wrong and rambling."""
    records = make_prompt_records("color", n_prompts, seed=seed)
    per = ["red", "green", "it is blue I think", "yellow"]
    rows = [r for r in records for _ in per]
    responses = [p for _ in records for p in per]
    return rows, responses


def _source(**fields) -> RewardSourceConfig:
    cfg = RewardSourceConfig(**fields)
    check_source(cfg, "reward.sources[0]")
    return cfg


def _health(url: str) -> dict:
    src = make_source(_source(name="probe", kind="http", url=url), CPU, False)
    src.close()
    return src.health


# -- (a) the same rewards as in-process --------------------------------------------------------------
@pytest.mark.parametrize("kind", ["srm", "verifier"])
def test_http_source_gives_the_rewards_of_the_same_source_in_process(kind, request, srm_dir):
    server = request.getfixturevalue(f"served_{kind}")
    local_cfg = (
        _source(name="rm", kind="srm", path=str(srm_dir), micro_batch_size=4)
        if kind == "srm"
        else _source(name="acc", kind="verifier", verifier="vocab_answer")
    )
    rows, responses = _samples()
    samples = samples_of(rows, responses, [{"response_length": len(r)} for r in responses])
    assert all(len(s.images) == 1 for s in samples)
    local = make_source(local_cfg, CPU, False).score(samples)
    remote_src = make_source(_source(name="remote", kind="http", url=server.url), CPU, False)
    try:
        remote = remote_src.score(samples)
    finally:
        remote_src.close()
    assert torch.equal(remote.values, local.values), (remote.values, local.values)
    assert remote.failed == local.failed == {}
    assert remote.extras == {"errors": 0.0, "timeouts": 0.0}
    assert len(set(local.values.tolist())) > 1  # not a constant: the values say something
    if kind == "verifier":  # strict: 1 where the response is the answer word ("it is blue I think" earns nothing)
        assert remote.values.tolist() == [float(row.answer == r) for row, r in zip(rows, responses)]
    health = _health(server.url)
    assert {k: health[k] for k in ("name", "kind", "holds_model", "grades")} == {
        "name": server.name,
        "kind": kind,
        "holds_model": kind == "srm",
        "grades": kind == "verifier",
    }


def test_requests_arriving_together_are_scored_in_one_call(served_verifier):
    """Four requests of 3 samples sent at once (http_batch_size 3, 4 in flight) within the 300 ms window: one
    call of the source; the values those of one request of 12."""
    rows, responses = _samples()
    samples = samples_of(rows, responses)
    split = make_source(
        _source(name="v", kind="http", url=served_verifier.url, http_batch_size=3, max_concurrency=4), CPU, False
    )
    whole = make_source(_source(name="v", kind="http", url=served_verifier.url), CPU, False)
    try:
        before = split.client.request("GET", f"{split.url}/health").data
        got = split.score(samples)
        after = split.client.request("GET", f"{split.url}/health").data
        assert torch.equal(got.values, whole.score(samples).values)
    finally:
        split.close()
        whole.close()
    assert after["requests"] - before["requests"] == 4
    assert after["calls"] - before["calls"] == 1


def test_the_server_fails_a_bad_image_alone_and_refuses_a_malformed_request(served_verifier):
    good = {"id": "a", "prompt": "p", "response": "red", "answer": "red", "metadata": {"vocabulary": ["red"]}}
    bad = {**good, "id": "b", "images": ["data:image/png;base64,@@not-base64@@"]}
    with httpx.Client(timeout=60) as http:
        r = http.post(f"{served_verifier.url}/score", json={"samples": [good, bad, good]})
        assert r.status_code == 200
        assert r.json() == {
            "values": [1.0, 0.0, 1.0],
            "failed": {"1": "samples[1]: bad base64 in data URI (Only base64 data is allowed)"},
            "extras": {},
        }
        r = http.post(f"{served_verifier.url}/score", json={"samples": [good, {**good, "reply": "x"}]})
        assert (r.status_code, r.text) == (
            400,
            "samples[1]: unknown field 'reply'; fields: id, prompt, response, answer, images, task, system, "
            "metadata, extra",
        )
        r = http.post(f"{served_verifier.url}/score", json={"samples": [{"id": "a", "prompt": "p"}]})
        assert (r.status_code, r.text) == (400, "samples[0].response: want a string")


def test_serve_reward_model_refuses_a_bad_source_in_one_line(capsys):
    assert main(["serve-reward-model", "source.kind=srm", "--port", "0"]) == 2
    assert capsys.readouterr().err == (
        "vlrft serve-reward-model: config error: source.path: empty; a srm source needs its model folder\n"
    )


# -- (b) a whole train-policy run ------------------------------------------------------------------------
REWARD_FILE = """
def score(sample):
    # varied rewards for a random policy's text (the colour words it never says would give 0 everywhere)
    return sum(map(ord, sample.response)) % 5 / 4
"""


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("http") / "reward.py"
    path.write_text(REWARD_FILE)
    return path


@pytest.mark.parametrize("kind", ["verifier", "function"])
def test_train_policy_with_the_reward_over_http_ends_bitwise_as_in_process(kind, request, tiny_model, tmp_path):
    """The vocab_answer verifier, and a function whose rewards vary (so that the advantages are not all 0)."""
    if kind == "verifier":
        server, spec = request.getfixturevalue("served_verifier"), "kind: verifier, verifier: vocab_answer"
    else:
        path = request.getfixturevalue("reward_file")
        server = Served("source.kind=function", f"source.function={path}:score", "source.name=fn")
        request.addfinalizer(server.kill)
        spec = f"kind: function, function: '{path}:score'"
    model = tiny_model("qwen2_5_vl")
    sources = {
        "local": f"reward.sources=[{{name: accuracy, {spec}}}]",
        "http": f"reward.sources=[{{name: accuracy, kind: http, url: '{server.url}'}}]",
    }
    summaries, weights, rewards = {}, {}, {}
    for name, source in sources.items():
        out = tmp_path / name
        args = ["train-policy", f"model.path={model}", f"train.output_dir={out}", "train.max_steps=3", source]
        assert main([*args, *POLICY, *QUIET]) == 0
        summaries[name] = json.loads((out / "summary.json").read_text())
        weights[name] = load_file(out / "final" / "model.safetensors")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rewards[name] = [(r[f"{ACC}/mean"], r[f"{ACC}/std"]) for r in rows if f"{ACC}/mean" in r]
    assert weights["http"].keys() == weights["local"].keys()
    assert all(torch.equal(weights["http"][k], weights["local"][k]) for k in weights["local"])
    assert rewards["http"] == rewards["local"] and len(rewards["http"]) == 3
    if kind == "function":
        assert all(std > 0 for _, std in rewards["http"])
    # the held-out accuracy graded by the served source (/verify) as by the one in-process
    for when in ("eval_before", "eval_after"):
        assert summaries["http"][when] == summaries["local"][when], when
    assert "accuracy" in summaries["http"]["eval_after"]


# -- (c) the server dies mid-run ---------------------------------------------------------------------
def _run_and_kill_server(tmp_path: Path, model: Path, source: str, server: Served, steps: int = 4):
    """train-policy in this process; the server SIGKILLed as soon as step 1 is logged. (exit code, seconds from
    the kill to the end of the run, the metrics rows)."""
    out = tmp_path / "run"
    killed: list[float] = []

    def watch() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not (out / "metrics.jsonl").is_file():
            time.sleep(0.01)
        while time.monotonic() < deadline and '"step": 1' not in (out / "metrics.jsonl").read_text():
            time.sleep(0.01)
        server.kill()
        killed.append(time.monotonic())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    args = ["train-policy", f"model.path={model}", f"train.output_dir={out}", f"train.max_steps={steps}", source]
    code = main([*args, *POLICY, *QUIET, "data.eval_source="])
    ended = time.monotonic()
    watcher.join(timeout=5)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return code, ended - killed[0], [r for r in rows if f"{ACC}/mean" in r]


def test_a_killed_server_gives_the_fallback_counted_and_the_run_goes_on(tiny_model, tmp_path):
    server = Served("source.verifier=vocab_answer", "source.name=acc")
    source = (
        f"reward.sources=[{{name: accuracy, kind: http, url: '{server.url}', fallback: -1.0, max_failure_share: 1.0}}]"
    )
    try:
        code, after_kill, rows = _run_and_kill_server(tmp_path, tiny_model("qwen2_5_vl"), source, server)
    finally:
        server.kill()
    assert code == 0
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert f"{ACC}/failures" not in rows[0] and rows[0][f"{ACC}/errors"] == 0.0
    last = rows[-1]  # the server was dead for the whole step: every sample failed, in one failed request
    assert last[f"{ACC}/failures"] == 16.0
    assert last[f"{ACC}/errors"] == 1.0 and last[f"{ACC}/timeouts"] == 0.0
    assert last[f"{ACC}/mean"] == -1.0 and last[f"{ACC}/n"] == 16.0
    # three failed steps at most, each one request of 4 tries with 0.5 + 1 + 2 s of backoff; the collapse
    # detectors' per-sample questions to the served verifier are not sent while the server is known gone
    assert after_kill < 60, after_kill


def test_a_killed_server_without_fallback_stops_the_run_naming_the_url(tiny_model, tmp_path, capsys):
    server = Served("source.verifier=vocab_answer")
    source = f"reward.sources=[{{name: accuracy, kind: http, url: '{server.url}', max_retries: 2}}]"
    try:
        code, after_kill, rows = _run_and_kill_server(tmp_path, tiny_model("qwen2_5_vl"), source, server)
    finally:
        server.kill()
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(
        r"vlrft train-policy: reward source error: reward source 'accuracy' \(http\) failed on record '[^']+': "
        + re.escape(f"{server.url}/score: connection failed (Connection refused) (after 3 tries)")
        + r" \(no fallback set: reward.sources\[\].fallback\)",
        lines[-1],
    ), lines[-1]
    assert rows and rows[-1]["step"] < 4
    assert after_kill < 60, after_kill  # the tries' backoff (0.5 + 1 s) and one step, never a hang


def test_a_server_that_is_not_there_stops_before_training(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(RewardSourceError) as err:
        make_source(_source(name="rm", kind="http", url=url, max_retries=1), CPU, False)
    assert str(err.value) == (
        f"reward source 'rm' (http): {url}/health: connection failed (Connection refused) (after 2 tries); "
        "is vlrft serve-reward-model running there?"
    )
    assert time.monotonic() - t0 < 10


# -- a server that hangs or misbehaves ---------------------------------------------------------------
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


HEALTH = {"name": "x", "kind": "srm", "holds_model": True, "grades": False}


@pytest.mark.parametrize(
    "behaviour, tries, why, timeouts",
    [
        ("hangs", 2, r"/score: timed out after 0.5 s \(after 2 tries\)", 1.0),
        ("500", 2, r"/score: HTTP 500 Internal Server Error: model crashed \(after 2 tries\)", 0.0),
        ("400", 1, r"/score: HTTP 400 Bad Request: samples\[0\]: no", 0.0),
        ("not json", 1, r"/score: malformed reply \(not JSON\): <html>oops</html>", 0.0),
        ("wrong count", 1, r"/score: malformed reply: 'values' must be 4 numbers, got \[1\.0\]", 0.0),
    ],
    ids=["hangs", "500", "400", "not-json", "wrong-count"],
)
def test_a_server_that_hangs_or_misbehaves_gives_the_fallback_counted(behaviour, tries, why, timeouts, capsys):
    async def health(request):
        return web.json_response(HEALTH)

    async def score(request):
        await server.record(request)
        if behaviour == "hangs":
            await asyncio.sleep(3600)
        if behaviour in ("500", "400"):
            return web.Response(status=int(behaviour), text="samples[0]: no" if behaviour == "400" else "model crashed")
        if behaviour == "not json":
            return web.Response(text="<html>oops</html>")
        return web.json_response({"values": [1.0]})

    server = LocalServer([web.get("/health", health), web.post("/score", score)])
    cfg = load_config(
        RewardPoolConfig,
        None,
        [
            f"sources=[{{name: rm, kind: http, url: '{server.url}', fallback: 0.25, max_failure_share: 1.0,"
            " timeout_s: 0.5, max_retries: 1}]",
            "device=cpu",
            "diagnostics_window=0",
        ],
    )
    pool = RewardPool(cfg)
    rows, responses = _samples(1)
    t0 = time.monotonic()
    try:
        out = pool.score(rows, responses)
    finally:
        pool.close()
        server.stop()
    assert time.monotonic() - t0 < 2 * 0.5 + 0.5 + 5  # two tries of 0.5 s and the 0.5 s backoff, at most
    assert out.per_source["rm"].tolist() == [0.25] * 4
    assert out.metrics["reward/rm/failures"] == 4.0
    assert out.metrics["reward/rm/timeouts"] == timeouts and out.metrics["reward/rm/errors"] == 1.0 - timeouts
    assert len(server.received) == tries
    assert len(server.received[0]["samples"]) == 4 and server.received[0]["samples"][0]["images"][0].startswith(
        "data:image/png;base64,"
    )
    warning = capsys.readouterr().err.strip()
    assert re.fullmatch(
        rf"warning: reward source 'rm' \(http\) failed on record '{rows[0].id}': {re.escape(server.url)}{why}; "
        r"given the fallback 0.25 \(counted in reward/rm/failures\)",
        warning,
    ), warning


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"kind": "http", "url": ""}, "reward.sources[0].url: empty; want http://HOST:PORT"),
        ({"kind": "http", "url": "localhost:8100"}, "reward.sources[0].url=localhost:8100: want http://HOST:PORT"),
        ({"kind": "http", "url": "http://h:port"}, "reward.sources[0].url=http://h:port: Port could not be cast"),
        ({"kind": "openai_judge", "url": "http://h:8000"}, "reward.sources[0].model: empty; name the judge model"),
        (
            {"kind": "openai_judge", "url": "http://h:8000", "model": "j", "judge_mode": "pairwise"},
            "reward.sources[0].judge_mode=pairwise: an openai_judge judges pointwise only",
        ),
        (
            {"kind": "openai_judge", "url": "http://h:8000", "model": "j", "api_key_env": "VLRFT_NO_SUCH_KEY"},
            "reward.sources[0].api_key_env=VLRFT_NO_SUCH_KEY: the environment variable is not set",
        ),
    ],
)
def test_a_bad_remote_source_config_is_one_line(fields, message):
    with pytest.raises(ConfigError) as err:
        _source(name="r", **fields)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


# -- (d) an OpenAI-compatible judge ------------------------------------------------------------------
VERDICTS = {"red": "The colour is right. <answer>yes</answer>", "green": "<answer>no</answer>", "blue": "hmm"}


def test_openai_judge_parses_the_servers_verdicts_and_sends_the_image_inline(monkeypatch):
    monkeypatch.setenv("VLRFT_TEST_JUDGE_KEY", "sk-test")

    async def chat(request):
        body = await server.record(request)
        text = next(p["text"] for p in body["messages"][-1]["content"] if p["type"] == "text")
        said = text.rsplit("Candidate answer: ", 1)[1]
        return web.json_response(
            {"choices": [{"index": 0, "message": {"role": "assistant", "content": VERDICTS[said]}}]}
        )

    server = LocalServer([web.post("/v1/chat/completions", chat)])
    records = make_prompt_records("color", 2, seed=3)
    responses = ["red", "green", "blue"]
    rows = [records[0]] * 2 + [records[1]]
    cfg = _source(
        name="judge",
        kind="openai_judge",
        url=server.url,
        model="tiny-judge",
        api_key_env="VLRFT_TEST_JUDGE_KEY",
        unparsable_reward=0.5,
        max_new_tokens=16,
    )
    src = make_source(cfg, CPU, False)
    try:
        scores = src.score(samples_of(rows, responses))
    finally:
        src.close()
        server.stop()
    assert scores.values.tolist() == [parse_judgment(VERDICTS["red"]), parse_judgment(VERDICTS["green"]), 0.5]
    assert scores.values.tolist() == [1.0, 0.0, 0.5] and scores.failed == {}
    assert scores.extras == {"errors": 0.0, "timeouts": 0.0, "unparsable": 1.0}
    assert len(server.received) == 3
    by_response = {b["messages"][-1]["content"][-1]["text"].rsplit(": ", 1)[1]: b for b in server.received}
    for row, response in zip(rows, responses):
        body = by_response[response]
        assert body["model"] == "tiny-judge" and body["max_tokens"] == 16 and body["temperature"] == 0.0
        system, user = body["messages"]
        assert system == {"role": "system", "content": JUDGE_SYSTEM_PROMPT}
        image, text = user["content"]  # no <image> placeholder in the prompt: the image first, as the grm kind
        assert text == {"type": "text", "text": judgment_prompt(row.prompt, response)}
        assert image["type"] == "image_url" and image["image_url"]["url"].startswith("data:image/png;base64,")
        sent = load_image(image["image_url"]["url"], max_pixels=None)
        assert sent.size == row.images[0].size and sent.tobytes() == row.images[0].tobytes()
    assert {h.get("Authorization") for h in server.headers} == {"Bearer sk-test"}


@pytest.mark.vllm
@pytest.mark.skip(
    reason="open (issue 24 item 4): vllm serve of the tiny Qwen2.5-VL judge fails on CPU before it listens: its "
    "processor asks for a video processor the tiny models do not have (OSError 'Can't load video processor'); "
    "importing vlrft.models in every server process (sitecustomize) and --limit-mm-per-prompt video 0 did not help"
)
def test_openai_judge_against_vllm_serve_gives_the_in_process_judges_rewards(tiny_model, tmp_path):
    """``vllm serve`` of a tiny judge: the rewards of ``kind: openai_judge`` equal the ``grm`` kind's on the same
    model (greedy judgments; vLLM and hf agree token for token on these models, tests/test_vllm_engine.py)."""
    pytest.importorskip("vllm", reason="vLLM is not installed here: bash scripts/setup.sh --vllm")
    judge = tiny_model("qwen2_5_vl", hidden=128, heads=2, kv_heads=2)  # head_dim 64: vLLM refuses 16
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(judge)]
    command += ["--served-model-name", "judge", "--host", "127.0.0.1", "--port", str(port), "--enforce-eager"]
    command += ["--max-model-len", "2048", "--gpu-memory-utilization", "0.3"]
    log = open(tmp_path / "vllm.log", "wb")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=subprocess_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(2)
        assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
        rows, responses = _samples(2)
        samples = samples_of(rows, responses)
        local = make_source(_source(name="j", kind="grm", path=str(judge), max_new_tokens=8), CPU, False)
        remote = make_source(
            _source(name="j", kind="openai_judge", url=f"http://127.0.0.1:{port}", model="judge", max_new_tokens=8),
            CPU,
            False,
        )
        try:
            want, got = local.score(samples), remote.score(samples)
        finally:
            remote.close()
        assert got.failed == {}
        assert torch.equal(got.values, want.values)
        assert got.extras["unparsable"] == want.extras["unparsable"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        log.close()
