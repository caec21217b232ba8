"""A served teacher for the tests of ``teacher.url`` (test_distillation_served.py): an OpenAI-compatible completions
server of a real model, written here with aiohttp (a thread of the test process, :class:`LocalServer`), answering
as ``vllm serve`` does the three routes vlrft asks: ``/v1/models`` (the served name and ``max_model_len``),
``/tokenize`` (a text's ids) and ``/v1/completions`` with token-id prompts and ``prompt_logprobs: 0`` (per prompt
token after the first, ``{token id: {"logprob", "rank", "decoded_token"}}`` from the model's raw log-softmax)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from aiohttp import web
from reward_servers import LocalServer
from transformers import AutoModelForCausalLM, AutoTokenizer


class CompletionsServer(LocalServer):
    """``model_dir`` served as ``name``; ``tokenizer_dir``: the tokenizer ``/tokenize`` uses (another vocabulary's,
    to be refused); ``mangle(k, choice)``: changes the choice of the ``k``-th prompt answered (malformed replies)."""

    def __init__(
        self,
        model_dir: Path,
        name: str = "teacher",
        max_model_len: int = 4096,
        tokenizer_dir: Path | None = None,
        mangle: Callable[[int, dict], Any] | None = None,
    ):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir or model_dir)
        self.name, self.max_model_len, self.mangle, self.answered = name, max_model_len, mangle, 0
        super().__init__(
            [
                web.get("/v1/models", self.models),
                web.post("/tokenize", self.tokenize),
                web.post("/v1/completions", self.completions),
            ]
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.name, "max_model_len": self.max_model_len}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self.record(request)
        ids = self.tok.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
        return web.json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids})

    async def completions(self, request: web.Request) -> web.Response:
        body = await self.record(request)
        if body.get("model") != self.name:
            return web.json_response({"error": {"message": f"model {body.get('model')} not served"}}, status=404)
        choices = []
        for k, ids in enumerate(body["prompt"]):
            with torch.no_grad():
                logits = self.model(torch.tensor([ids])).logits[0].float()
            logp = torch.log_softmax(logits, -1)
            entries: list[Any] = [None]
            for t in range(1, len(ids)):
                row, token = logp[t - 1], ids[t]
                rank = int((row > row[token]).sum()) + 1
                entries.append({str(token): {"logprob": float(row[token]), "rank": rank, "decoded_token": ""}})
            choice = {"index": k, "text": "", "prompt_logprobs": entries, "finish_reason": "length"}
            if self.mangle is not None:
                choice = self.mangle(self.answered, choice)
            self.answered += 1
            choices.append(choice)
        return web.json_response({"object": "text_completion", "model": self.name, "choices": choices})
