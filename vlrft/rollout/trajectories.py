"""Multi-turn rollouts with tools, on any rollout engine, a whole batch turn by turn.

Turn 1 is the engine's ordinary ``generate`` (n samples per prompt: the prompt and its images once per group); with
FIRE (``SamplingParams.first_token_temperature``) its first token is the only one drawn hot. Keyed sampling
(``SamplingParams.keys``, one key per prompt): each later turn of sample j of a prompt is keyed by a key derived from
the prompt's, j and the turn (``base.subkey``), so a trajectory's tokens do not depend on which others share its turns.
Each sampled turn is read for tool calls (``vlrft.tools.parse_tool_calls``); a turn without a call is the answer
and ends its trajectory. Otherwise the calls run (``vlrft.tools.ToolBox``: time limits, errors as observations),
their results become the template's tool turn (``data_pipelines.turns.encode_observation``: text and image parts,
then the next assistant header), and the trajectories still open continue together: each as one prompt made of
its prompt, its sampled tokens and its observations (images included), one sample each. Finished trajectories
leave the batch. A trajectory ends when it answers, when a turn reaches ``rollout.max_new_tokens`` without
ending ("length"), when the next observation or turn would pass ``tools.max_tokens`` ("budget"), or when the
policy calls a tool in turn ``tools.max_turns`` ("max_turns").

How trajectories are logged (:func:`turn_log`) and their tool use summed up per step or evaluation
(:func:`tool_summary`) live here too.

The engine re-reads each open trajectory's whole context every turn (the hf engine prefills it again; vLLM's
prefix cache keeps what it can): simple and exact, and the prompt's vision tower runs again each turn.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from PIL import Image

from data_pipelines.collate import EncodedPrompt, tokenizer_of
from data_pipelines.turns import concat, encode_observation
from vlrft.rollout.base import Rollout, SamplingParams, Trajectory, subkey
from vlrft.tools.base import CallError, ToolCall, ToolResult, parse_tool_calls, tool_message
from vlrft.tools.box import ToolBox, ToolsConfig
from vlrft.tools.builtin import ImageView, view_of


@dataclass
class _Open:
    """A trajectory while it is built."""

    prompt_index: int
    prompt: EncodedPrompt
    conversation: list[dict[str, Any]]
    views: list[ImageView]
    parts: list[EncodedPrompt] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    logprobs: list[torch.Tensor | None] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    calls: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    returned: int = 0  # images returned by tools
    used: int = 0  # tokens after the prompt
    finish: str = ""
    text: str = ""


def _withheld(result: ToolResult) -> ToolResult:
    """A tool's answer without its information: blank images of the same sizes, no text."""
    return ToolResult("", [Image.new("RGB", im.size, (128, 128, 128)) for im in result.images])


def _call_log(call: ToolCall | CallError) -> dict[str, Any]:
    """A call as a turn's log keeps it: its name and arguments, or its error."""
    if isinstance(call, ToolCall):
        return {"name": call.name, "arguments": call.arguments}
    return {"error": call.kind, "message": call.message}


class TrajectoryRunner:
    """Runs trajectories for an engine and a processor with a run's tools (``box``). ``withheld``: the same prompts,
    calls and turns, but each tool's answer is withheld: its images are replaced by blank (mid-grey) images of the
    same size and its text by nothing, so the policy can only answer from what the prompt showed it; the accuracy
    then measured is what remains without the information the tools return."""

    def __init__(self, engine: Any, processor: Any, box: ToolBox, cfg: ToolsConfig, withheld: bool = False):
        self.engine, self.processor, self.box, self.cfg = engine, processor, box, cfg
        self.withheld = withheld
        self.schemas = box.schemas
        tok = tokenizer_of(processor)
        self.tokenizer = tok
        self.end_text = "<|im_end|>" if "<|im_end|>" in tok.get_vocab() else tok.eos_token
        self.end_id = tok.convert_tokens_to_ids(self.end_text)
        self.reads_images = getattr(processor, "image_processor", None) is not None
        self.bounds = dict(box.bounds)

    def run(self, records: list[Any], prompts: list[EncodedPrompt], sampling: SamplingParams) -> list[Rollout]:
        """``sampling.n`` trajectories per prompt, prompt-major, as rollouts with their :class:`Trajectory`."""
        limit = sampling.max_new_tokens
        budgeted = dataclasses.replace(sampling, max_new_tokens=min(limit, self.cfg.max_tokens))
        first = [self._within(x, self.cfg.max_tokens, limit) for x in self.engine.generate(prompts, budgeted)]
        views = [[view_of(im, self.bounds) for im in r.images] for r in records]
        trajs = [
            _Open(
                x.prompt_index,
                prompts[x.prompt_index],
                list(prompts[x.prompt_index].messages or []),
                list(views[x.prompt_index]),
            )
            for x in first
        ]
        active = list(range(len(trajs)))
        rollouts = first
        for turn in range(1, self.cfg.max_turns + 1):
            calling = [i for i, x in zip(active, rollouts) if self._take_turn(trajs[i], x, turn)]
            results = self._run_calls(trajs, calling)
            active = [i for i in calling if self._observe(trajs[i], results[i])]
            if not active:
                break
            left = [self.cfg.max_tokens - trajs[i].used for i in active]
            # FIRE heats the trajectory's first token only, the response's first as in a single turn; later turns
            # still report their tokens' log-probs where turn 1 did
            step = dataclasses.replace(sampling.after_first_token(), n=1, max_new_tokens=min(limit, max(left)))
            if sampling.keys is not None:  # each trajectory (sample j of its prompt) keyed afresh for each turn
                keys = [subkey(sampling.keys[trajs[i].prompt_index], "turn", i % sampling.n, turn) for i in active]
                step = dataclasses.replace(step, keys=keys)
            rollouts = self.engine.generate([concat([trajs[i].prompt, *trajs[i].parts]) for i in active], step)
            rollouts = [self._within(x, room, limit) for x, room in zip(rollouts, left)]
        return [self._rollout(t) for t in trajs]

    # ------------------------------------------------------------------ one turn
    def _within(self, x: Rollout, room: int, limit: int) -> Rollout:
        """A turn within the trajectory's remaining budget ``room``: cut to it when the batch's limit was larger, and
        finished ``budget`` (not ``length``) when the budget, not the turn's own ``limit``, stopped it."""
        if x.response_ids.numel() < room or (x.response_ids.numel() == room and x.finish_reason != "length"):
            return x
        if x.response_ids.numel() == room and room >= limit:
            return x  # the turn's own limit
        ids = x.response_ids[:room]
        lp = x.logprobs[:room] if x.logprobs is not None else None
        return Rollout(x.prompt_index, ids, self.tokenizer.decode(ids, skip_special_tokens=True), "budget", lp)

    def _take_turn(self, t: _Open, x: Rollout, turn: int) -> bool:
        """Record a sampled turn; True when it calls tools that will be answered."""
        t.parts.append(EncodedPrompt(x.response_ids.long()))
        t.sampled.append(True)
        t.logprobs.append(x.logprobs)
        t.used += x.response_ids.numel()
        t.turns.append({"text": x.text, "calls": [], "observations": []})
        t.conversation.append({"role": "assistant", "content": [{"type": "text", "text": x.text}]})
        t.text = x.text
        ended = x.response_ids.numel() > 0 and int(x.response_ids[-1]) == self.end_id
        calls = parse_tool_calls(x.text)
        if not ended:  # cut by the turn's or the trajectory's length: no call of a cut turn runs
            t.finish = x.finish_reason if x.finish_reason in ("budget", "length") else "length"
            self._cut_calls(t, calls)
            return False
        if not calls:
            t.finish = "stop"
            return False
        if turn == self.cfg.max_turns:
            t.finish = "max_turns"
            return False
        t.turns[-1]["calls"] = [_call_log(c) for c in calls]
        t.turns[-1]["pending"] = calls
        return True

    @staticmethod
    def _cut_calls(t: _Open, calls: list[ToolCall | CallError]) -> None:
        """The calls of a turn cut before its end are failed calls, each counted (``tools.error_reward``) and
        logged: a ``<tool_call>`` left open (``parse_tool_calls`` reads it as one malformed call) or one that never
        ran because its turn did not end. Uncounted, a policy learnt to dodge the penalty of a malformed call by
        never closing the turn: 32 repeated ``<tool_call>`` tags cut at the length limit scored 0 where a malformed
        call ending its turn scored -0.5 (docs/tools.md)."""
        failed = [
            c if isinstance(c, CallError) else CallError("malformed", "its turn was cut before it ended", c.name)
            for c in calls
        ]
        for c in failed:
            t.errors[c.kind] += 1
        t.turns[-1]["calls"] = [_call_log(c) for c in failed]

    def _run_calls(self, trajs: list[_Open], calling: list[int]) -> dict[int, list[ToolResult | CallError]]:
        jobs: list[tuple[int, int, Any]] = []
        out: dict[int, list[Any]] = {}
        for i in calling:
            calls = trajs[i].turns[-1].pop("pending")
            out[i] = list(calls)
            for k, c in enumerate(calls):
                if isinstance(c, CallError):
                    continue
                if k >= self.cfg.max_calls_per_turn:
                    out[i][k] = CallError(
                        "bad_arguments", f"at most {self.cfg.max_calls_per_turn} calls per turn", c.name
                    )
                else:
                    jobs.append((i, k, c))
        if jobs:
            done = self.box.run_many([(c, list(trajs[i].views)) for i, _, c in jobs])
            for (i, k, _), result in zip(jobs, done):
                out[i][k] = result
        return out

    def _observe(self, t: _Open, results: list[ToolResult | CallError]) -> bool:
        """The tool turn appended (True), or the trajectory ended because it would pass the budget."""
        messages, new_images, log = [], [], []
        for k, r in enumerate(results):
            if isinstance(r, ToolResult) and r.images and not self.reads_images:
                r = CallError("image_limit", "this model reads no images", "")
            if isinstance(r, ToolResult) and t.returned + len(new_images) + len(r.images) > self.cfg.max_images:
                r = CallError("image_limit", f"at most {self.cfg.max_images} images per conversation", "")
            if isinstance(r, CallError):
                t.errors[r.kind] += 1
            else:
                t.calls[t.turns[-1]["calls"][k]["name"]] += 1
                r = _withheld(r) if self.withheld else ToolResult(r.text, [im.convert("RGB") for im in r.images])
                new_images += r.images
            messages.append(tool_message(r))
            shown = [c for c in messages[-1]["content"] if c["type"] == "text"]
            log.append({"text": shown[0]["text"] if shown else "", "images": len(messages[-1]["content"]) - len(shown)})
        t.turns[-1]["observations"] = log
        obs = encode_observation(
            self.processor, t.conversation, messages, tools=self.schemas, end_of_turn=self.end_text
        )
        if t.used + obs.input_ids.numel() + 1 > self.cfg.max_tokens:
            t.finish = "budget"
            return False
        t.parts.append(obs)
        t.sampled.append(False)
        t.logprobs.append(None)
        t.used += obs.input_ids.numel()
        t.conversation += messages
        t.returned += len(new_images)
        t.views += [view_of(im, self.bounds) for im in new_images]
        return True

    # ------------------------------------------------------------------ the result
    def _rollout(self, t: _Open) -> Rollout:
        response = concat(t.parts)
        mask = torch.cat(
            [torch.full((p.input_ids.numel(),), int(s), dtype=torch.long) for p, s in zip(t.parts, t.sampled)]
        )
        logprobs = None
        if all(lp is not None for lp, s in zip(t.logprobs, t.sampled) if s):
            logprobs = torch.cat(
                [
                    lp.float() if s else torch.zeros(p.input_ids.numel())
                    for p, s, lp in zip(t.parts, t.sampled, t.logprobs)
                ]
            )
        trajectory = Trajectory(
            action_mask=mask,
            response=response,
            turns=t.turns,
            messages=t.conversation[len(t.prompt.messages or []) :],
            calls=dict(t.calls),
            errors=dict(t.errors),
        )
        return Rollout(t.prompt_index, response.input_ids, t.text, t.finish, logprobs, trajectory)


def turn_log(trajectory: Trajectory) -> dict[str, Any]:
    """A trajectory as samples.jsonl (``vlrft eval``'s and train-policy's) keeps it: its turns (text, calls,
    observations with their image counts) and its calls and failed calls counted."""
    return {"turns": trajectory.turns, "tool_calls": trajectory.calls, "tool_errors": trajectory.errors}


def tool_summary(responses: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Tool use over responses with turns (samples.jsonl rows of ``vlrft eval``, and each step of train-policy):
    turns and calls per response, the share that called a tool, failed calls per response, per tool and per
    failure, the share cut by the token budget or by the turn limit, and images returned per response."""
    n = len(responses)
    calls: Counter = Counter()
    errors: Counter = Counter()
    for r in responses:
        calls.update(r.get("tool_calls", {}))
        errors.update(r.get("tool_errors", {}))
    out = {
        "tools/turns": sum(len(r.get("turns", [])) for r in responses) / n,
        "tools/calls": sum(calls.values()) / n,
        "tools/call_rate": sum(bool(r.get("tool_calls") or r.get("tool_errors")) for r in responses) / n,
        "tools/errors": sum(errors.values()) / n,
        "tools/cut_by_budget": sum(r.get("finish_reason") == "budget" for r in responses) / n,
        "tools/max_turns": sum(r.get("finish_reason") == "max_turns" for r in responses) / n,
        "tools/images": sum(o["images"] for r in responses for t in r.get("turns", []) for o in t["observations"]) / n,
    }
    out.update({f"tools/calls/{k}": v / n for k, v in sorted(calls.items())})
    out.update({f"tools/errors/{k}": v / n for k, v in sorted(errors.items())})
    return out
