"""Reward sources served over HTTP (issue 24): ``vlrft serve-reward-model`` serving a real tiny SRM, a judge and a
rule verifier in its own process, ``kind: http`` scoring through it exactly as the source does in-process (a
whole train-policy run ends bitwise equal), replies in strict JSON (a non-finite reward: null, that sample
failed), preflight checking every record for the fields the served source needs, and a server that dies, hangs
or misbehaves giving the fallback (counted) or one line naming the URL, in bounded time. ``kind: openai_judge``:
tests/test_reward_openai_judge.py."""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from aiohttp import web
from launch import QUIET
from reward_servers import LocalServer, Served, colour_samples, source_cfg
from safetensors.torch import load_file

from data_pipelines.synthetic import make_prompt_records
from reward_models.kinds import make_source
from reward_models.pool import RewardPool, RewardPoolConfig, RewardSourceError
from reward_models.remote import sample_json
from reward_models.samples import samples_of
from vlrft.cli import main
from vlrft.config import ConfigError, load_config
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.preflight import preflight_policy

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
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


def _health(url: str) -> dict:
    src = make_source(source_cfg(name="probe", kind="http", url=url), CPU, False)
    src.close()
    return src.health


# -- (a) the same rewards as in-process --------------------------------------------------------------
@pytest.mark.parametrize("kind", ["srm", "verifier"])
def test_http_source_gives_the_rewards_of_the_same_source_in_process(kind, request, srm_dir):
    server = request.getfixturevalue(f"served_{kind}")
    local_cfg = (
        source_cfg(name="rm", kind="srm", path=str(srm_dir), micro_batch_size=4)
        if kind == "srm"
        else source_cfg(name="acc", kind="verifier", verifier="vocab_answer")
    )
    rows, responses = colour_samples()
    samples = samples_of(rows, responses, [{"response_length": len(r)} for r in responses])
    assert all(len(s.images) == 1 for s in samples)
    local = make_source(local_cfg, CPU, False).score(samples)
    remote_src = make_source(source_cfg(name="remote", kind="http", url=server.url), CPU, False)
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
    rows, responses = colour_samples()
    samples = samples_of(rows, responses)
    split = make_source(
        source_cfg(name="v", kind="http", url=served_verifier.url, http_batch_size=3, max_concurrency=4), CPU, False
    )
    whole = make_source(source_cfg(name="v", kind="http", url=served_verifier.url), CPU, False)
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


def test_the_server_reads_no_file_of_its_own_disk_unless_told(served_verifier, tmp_path):
    """A client sends images inline; a path would have the server open any file its user can read. Refused (400,
    naming the image) by default; read under --image-root (tests/test_reliability_server.py: nowhere else)."""
    image = tmp_path / "red.png"
    make_prompt_records("color", 1, seed=5)[0].images[0].save(image)
    sample = {"id": "a", "prompt": "p", "response": "red", "answer": "red", "metadata": {"vocabulary": ["red"]}}
    with httpx.Client(timeout=60) as http:
        r = http.post(f"{served_verifier.url}/score", json={"samples": [{**sample, "images": [str(image)]}]})
        assert (r.status_code, r.text) == (
            400,
            "samples[0].images[0]: not a data URI; this server reads no files of its own disk "
            "(serve-reward-model --image-root DIR reads them)",
        )
    server = Served("source.verifier=vocab_answer", args=("--image-root", str(tmp_path)))
    try:
        with httpx.Client(timeout=60) as http:
            r = http.post(f"{server.url}/score", json={"samples": [{**sample, "images": [str(image)]}]})
        assert (r.status_code, r.json()["values"]) == (200, [1.0])
    finally:
        server.kill()


def test_an_api_key_guards_the_server_and_a_client_without_it_stops_at_preflight(monkeypatch):
    """--api-key-env NAME: /score and /verify answer 401 without ``Authorization: Bearer KEY``; /health stays
    open (it says auth: true) and checks a key that is sent. The http source sends the key of its api_key_env;
    one without a key, or with a wrong one, stops when it is built (preflight), naming the URL."""
    monkeypatch.setenv("VLRFT_TEST_KEY", "s3cret")
    monkeypatch.setenv("VLRFT_WRONG_KEY", "guess")
    server = Served("source.verifier=vocab_answer", args=("--api-key-env", "VLRFT_TEST_KEY"))
    sample = {"id": "a", "prompt": "p", "response": "red", "answer": "red", "metadata": {"vocabulary": ["red"]}}
    try:
        with httpx.Client(timeout=60) as http:
            for path in ("/score", "/verify"):
                r = http.post(f"{server.url}{path}", json={"samples": [sample]})
                assert (r.status_code, r.text) == (401, "no API key: this server wants 'Authorization: Bearer KEY'")
            r = http.post(f"{server.url}/score", json={"samples": [sample]}, headers={"Authorization": "Bearer x"})
            assert (r.status_code, r.text) == (401, "a wrong API key: this server wants 'Authorization: Bearer KEY'")
            assert http.get(f"{server.url}/health").json()["auth"] is True
        keyed = make_source(source_cfg(name="v", kind="http", url=server.url, api_key_env="VLRFT_TEST_KEY"), CPU, False)
        try:
            rows, responses = colour_samples()
            got = keyed.score(samples_of(rows, responses))
            assert got.failed == {} and got.values.tolist() == [float(r.answer == t) for r, t in zip(rows, responses)]
            assert keyed.verifier().check("red", "red", vocabulary=["red"]).score == 1.0
        finally:
            keyed.close()
        with pytest.raises(RewardSourceError) as no_key:
            make_source(source_cfg(name="v", kind="http", url=server.url), CPU, False)
        assert str(no_key.value) == (
            f"reward source 'v' (http): {server.url} requires an API key (it was started with --api-key-env); "
            "set the source's api_key_env to the name of an environment variable holding it"
        )
        with pytest.raises(RewardSourceError) as wrong:
            make_source(source_cfg(name="v", kind="http", url=server.url, api_key_env="VLRFT_WRONG_KEY"), CPU, False)
        assert str(wrong.value) == (
            f"reward source 'v' (http): {server.url}/health: HTTP 401 Unauthorized: a wrong API key: this server "
            "wants 'Authorization: Bearer KEY'; set the source's api_key_env"
        )
    finally:
        server.kill()


def test_serve_reward_model_refuses_an_unset_key_variable_and_warns_off_loopback_without_one(capsys):
    assert main(["serve-reward-model", "source.verifier=vocab_answer", "--api-key-env", "VLRFT_UNSET_KEY"]) == 2
    assert capsys.readouterr().err == (
        "vlrft serve-reward-model: config error: --api-key-env=VLRFT_UNSET_KEY: the environment variable is not set "
        "or empty\n"
    )
    server = Served("source.verifier=vocab_answer", args=("--host", "0.0.0.0"), expect_host="0.0.0.0")
    try:
        warning = server.proc.stderr.readline().decode()
    finally:
        server.kill()
    assert warning == (
        "warning: serving on 0.0.0.0 without --api-key-env: anyone who reaches this port can use the source\n"
    )


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


def test_a_server_that_is_not_there_stops_before_training(tmp_path, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(RewardSourceError) as err:
        make_source(source_cfg(name="rm", kind="http", url=url, max_retries=1), CPU, False)
    why = (
        f"reward source 'rm' (http): {url}/health: connection failed (Connection refused) (after 2 tries); "
        "is vlrft serve-reward-model running there?"
    )
    assert str(err.value) == why
    assert time.monotonic() - t0 < 10
    # train-policy: preflight asks /health for the fields the source needs, before the run folder or a model
    source = f"reward.sources=[{{name: rm, kind: http, url: '{url}', max_retries: 1}}]"
    assert main(["train-policy", source, f"train.output_dir={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err == f"vlrft train-policy: reward source error: {why}\n"
    assert not (tmp_path / "run").exists()


# -- a server that hangs or misbehaves ---------------------------------------------------------------
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
    rows, responses = colour_samples(1)
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
        source_cfg(name="r", **fields)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


# -- strict JSON -------------------------------------------------------------------------------------
def _strict_json(text: str):
    """``json.loads`` as a strict parser reads (RFC 8259 has no NaN or Infinity: refused)."""

    def refuse(constant: str):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_a_non_finite_reward_travels_as_null_and_fails_that_sample_alone(trained_judge, capsys):
    """A served judge whose unparsable judgments are worth NaN (``unparsable_reward: .nan``): the reply is strict
    JSON, null where the judge's reward is NaN and the reason in ``failed``; through ``kind: http`` the pool gives
    the fallback to those samples alone (counted), and the judge's verdicts to the others."""
    judge = trained_judge()  # yes for the candidate 'red'; the rambling response's judgment is unparsable
    fields = dict(name="judge", kind="grm", path=str(judge), unparsable_reward=math.nan, max_new_tokens=16)
    server = Served(*(f"source.{k}={v}" for k, v in fields.items()))
    try:
        rows, responses = colour_samples(2)
        samples = samples_of(rows, responses)
        local = make_source(source_cfg(**fields), CPU, False).score(samples).values.tolist()
        nan_at = [i for i, v in enumerate(local) if math.isnan(v)]
        assert 0 < len(nan_at) < len(samples), local  # some judged, some not
        with httpx.Client(timeout=300) as http:
            reply = http.post(f"{server.url}/score", json={"samples": [sample_json(s) for s in samples]})
        body = _strict_json(reply.text)
        assert body["values"] == [None if math.isnan(v) else v for v in local]
        assert body["failed"] == {str(i): "non-finite reward nan" for i in nan_at}
        pool_cfg = [
            f"sources=[{{name: judge, kind: http, url: '{server.url}', fallback: -0.5, max_failure_share: 1.0}}]",
            "device=cpu",
            "diagnostics_window=0",
        ]
        pool = RewardPool(load_config(RewardPoolConfig, None, pool_cfg))
        try:
            out = pool.score(rows, responses)
        finally:
            pool.close()
    finally:
        server.kill()
    assert out.per_source["judge"].tolist() == [-0.5 if math.isnan(v) else v for v in local]
    assert {0.0, 1.0} <= set(out.per_source["judge"].tolist())  # the verdicts, parsed
    assert out.metrics["reward/judge/failures"] == len(nan_at)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: reward source 'judge' (http) failed on record '{rows[nan_at[0]].id}': {server.url}/score: "
        "non-finite reward nan; given the fallback -0.5 (counted in reward/judge/failures)"
    ]


# -- preflight knows what a served source needs --------------------------------------------------------
@pytest.mark.parametrize("served, field", [("verifier", "answer"), ("function", "vocabulary")])
def test_preflight_checks_every_record_for_the_fields_the_served_source_needs(served, field, request, tmp_path, capsys):
    """The served vocab_answer verifier needs the answer; the your-task example's function, served with
    ``needs: [vocabulary]``, its metadata field: a record without it is one line naming file, line and field,
    before anything loads."""
    if served == "verifier":
        server = request.getfixturevalue("served_verifier")
    else:
        reward = REPO / "examples" / "your_task" / "reward.py"
        server = Served("source.kind=function", f"source.function={reward}:score", "source.needs=[vocabulary]")
        request.addfinalizer(server.kill)
    assert _health(server.url)["needs"] == [field]
    good = {"id": "a", "prompt": "Which colour?", "answer": "red", "vocabulary": ["red", "green"]}
    bad = {k: v for k, v in {**good, "id": "b"}.items() if k != field}
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (good, good | {"id": "c"}, bad)))
    source = f"reward.sources=[{{name: remote, kind: http, url: '{server.url}'}}]"
    args = ["train-policy", f"data.train_source={data}", "data.eval_source=", "rollout.rollout_batch_size=1", source]
    assert main([*args, f"train.output_dir={tmp_path / 'run'}"]) == 2
    what = "no answer" if field == "answer" else f"no {field!r}"
    assert capsys.readouterr().err == (
        f"vlrft train-policy: data error: {data}:3 field {field!r}: record 'b' has {what}, which reward source "
        f"'remote' (http {server.url}) needs\n"
    )
    assert not (tmp_path / "run").exists()  # refused before the model was built or the folder written
    data.write_text("".join(json.dumps(r) + "\n" for r in (good, good | {"id": "c"})))
    cfg = load_config(PolicyTrainConfig, None, [*args[1:], f"train.output_dir={tmp_path / 'run'}"])
    assert preflight_policy(cfg, world=1)["data.train_source"].kept == 2
