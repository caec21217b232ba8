"""``kind: openai_judge``: a judge behind an OpenAI-compatible chat server (issue 24). Against a server written here
with aiohttp (the request's shape, the image inline, the key, the verdicts parsed), and, in the vllm suite,
against vLLM's own OpenAI-compatible server of a tiny trained judge: the same judgments, token for token, and so
the same rewards as the ``grm`` kind gives in-process, with the image reaching the model."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import torch
from aiohttp import web
from reward_servers import LocalServer, colour_samples, source_cfg, vllm_serve

from data_pipelines.collate import encode_prompt
from data_pipelines.formatting import JUDGE_SYSTEM_PROMPT, judgment_prompt
from data_pipelines.images import load_image, png_data_uri
from data_pipelines.records import PromptRecord
from data_pipelines.synthetic import make_prompt_records
from reward_models.generative import parse_judgment
from reward_models.kinds import make_source
from reward_models.samples import samples_of

CPU = torch.device("cpu")


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
    cfg = source_cfg(
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


# -- vLLM's OpenAI-compatible server -------------------------------------------------------------------
@pytest.mark.vllm
def test_openai_judge_against_vllm_serve_gives_the_in_process_judges_rewards(trained_judge, tmp_path):
    """vLLM's server of a tiny judge trained to say yes for 'red': for each sample it writes the judgment the
    ``grm`` kind writes in-process (greedy; vLLM and hf agree token for token on these models,
    tests/test_vllm_engine.py), so ``kind: openai_judge`` gives the ``grm`` kind's rewards exactly, its verdicts
    parsed both ways; the image sent inline reaches the model (its tokens in the server's prompt count, and
    another image changes the judgment's log-probs)."""
    pytest.importorskip("vllm", reason="vLLM is not installed here: bash scripts/setup.sh --vllm")
    judge = trained_judge(hidden=128, heads=2, kv_heads=2)  # head_dim 64: vLLM refuses 16
    log_path = tmp_path / "vllm.log"
    with open(log_path, "wb") as log:
        t0 = time.monotonic()
        proc, url = vllm_serve(judge, log, "judge")
        try:
            assert url is not None, log_path.read_text()[-3000:]
            print(f"vLLM server of the tiny judge listening after {time.monotonic() - t0:.0f} s")
            rows, responses = colour_samples(2)
            samples = samples_of(rows, responses)
            local = make_source(source_cfg(name="j", kind="grm", path=str(judge), max_new_tokens=16), CPU, False)
            remote_cfg = source_cfg(name="j", kind="openai_judge", url=url, model="judge", max_new_tokens=16)
            remote = make_source(remote_cfg, CPU, False)
            try:
                want, got = local.score(samples), remote.score(samples)
                _, texts = local.grm.score([(s.prompt, s.images, s.response, s.system) for s in samples])
                # the requests kind: openai_judge sends, asking for the judgment's log-probs too; the first again,
                # then the first with the image of a record of another colour
                requests = [{**remote._request([s], {}), "logprobs": True} for s in samples]
                other = next(r for r in make_prompt_records("color", 4, seed=5) if r.answer != rows[0].answer)
                requests += [requests[0], _with_image(requests[0], png_data_uri(other.images[0]))]
                replies = [httpx.post(remote.chat_url, json=r, timeout=120).json() for r in requests]
            finally:
                remote.close()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    said = [r["choices"][0]["message"]["content"] for r in replies]
    print("judgments:", dict(zip(responses, said)))
    assert said[: len(samples)] == texts  # token for token
    assert got.failed == {} and torch.equal(got.values, want.values), (got.values, want.values)
    assert got.extras["unparsable"] == want.extras["unparsable"]
    assert {0.0, 1.0} <= set(got.values.tolist())  # verdicts parsed, both ways
    assert got.values.tolist()[:2] == [1.0, 0.0]  # 'red': yes; 'green': no
    # the image's tokens are in the server's prompt, as in the grm kind's encoding of the same conversation
    s = samples[0]
    record = PromptRecord(
        id="0", prompt=judgment_prompt(s.prompt, s.response), images=s.images, system=local.grm.system
    )
    encoded = encode_prompt(local.processor, record)
    image_pad = local.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((encoded.input_ids == image_pad).sum()) == 4  # a 56 x 56 image: 4 x 4 patches of 14, merged 2 x 2
    assert replies[0]["usage"]["prompt_tokens"] == encoded.input_ids.numel()
    # the same request gives the same log-probs; the same judgment text with another image, other log-probs
    logprobs = [[t["logprob"] for t in r["choices"][0]["logprobs"]["content"]] for r in replies]
    first, repeated, swapped = logprobs[0], logprobs[-2], logprobs[-1]
    assert repeated == first and swapped != first, (first, swapped)
    print(f"first judgment's log-probs {first}; with another image {swapped}")


def _with_image(request: dict, uri: str) -> dict:
    """A chat request with its (one) image replaced by ``uri``."""
    content = [
        {"type": "image_url", "image_url": {"url": uri}} if part["type"] == "image_url" else part
        for part in request["messages"][-1]["content"]
    ]
    return {**request, "messages": [*request["messages"][:-1], {"role": "user", "content": content}]}
