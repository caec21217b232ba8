"""FIRE sampling (``rollout.first_token_temperature``; Chen et al. 2024, arXiv:2410.21236) on the hf engine, with a
real tiny Qwen2.5-VL:

- over 4000 draws of two tokens on one prompt, the first token's empirical distribution is the softmax of the model's
  own logits (float64) at the hot temperature, top-k filtered, and the pair's is that times the second token's softmax
  at the normal temperature given the first: total variation within a bound derived from the sample count, while the
  distributions FIRE replaces lie many bounds away;
- the log-prob the engine reports for each drawn token is that of the distribution it was drawn from (the first
  token's at the hot temperature, the others' at the normal one) within 1e-5, on every path the engine takes: the
  module or its inference copy, prefill once or not, a dynamic or a static cache;
- of a multi-turn trajectory only the first assistant turn's first token is hot;
- the config: a temperature <= 0 is one line; held-out evaluation is unchanged by it; a training step carries the
  first token's log-prob as drawn into rollout correction.

The vllm engine's FIRE (two requests: the first token hot, then the rest) is tested here too, in the vllm suite
(marker ``vllm``; skipped where vLLM is absent), and its stop-string cut across the two requests in the default one.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from data_pipelines.collate import collate_prompts, encode_prompt, tokenizer_of
from data_pipelines.records import PromptRecord
from data_pipelines.turns import concat
from vlrft.config import ConfigError, load_config
from vlrft.models.loading import load_model
from vlrft.rollout import SamplingParams, make_engine
from vlrft.rollout.base import vision_token_ids
from vlrft.rollout.hf import HFEngineConfig
from vlrft.rollout.vllm_engine import _straddling_stop
from vlrft.trainer.config import PolicyTrainConfig

T, T_FIRST, TOP_K, N = 0.02, 1.0, 8, 4000  # a peaked normal temperature, a flat hot one: far apart on this model


@pytest.fixture(scope="module")
def policy(tiny_model):
    model, processor = load_model(str(tiny_model("qwen2_5_vl")), "float32")
    return model.eval(), processor


def _prompt(processor):
    return encode_prompt(processor, PromptRecord(id="a", prompt="red green blue"))


def _next_logits(model, processor, ids: list[int]) -> torch.Tensor:
    """float64 ``[V]`` logits of the token after ``ids`` (a text prompt), the vision tokens at -inf as every engine
    has them."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, -1].double()
    logits[vision_token_ids(tokenizer_of(processor))] = -math.inf
    return logits


def _drawn_from(logits: torch.Tensor, temperature: float, top_k: int = 0) -> torch.Tensor:
    """float64 probabilities of the distribution a token is drawn from: softmax(logits / temperature), top-k kept."""
    scaled = logits / temperature
    if top_k:
        kept = scaled.topk(top_k).indices
        scaled = torch.full_like(scaled, -math.inf).index_copy(0, kept, scaled[kept])
    return torch.softmax(scaled, -1)


def tv_bound(cells: int, n: int, delta: float = 1e-3) -> float:
    """A bound on the total variation between an n-sample empirical distribution and its source over ``cells``
    outcomes, exceeded with probability below ``delta``: E[TV] <= 1/2 sqrt((cells - 1) / n) (Cauchy-Schwarz over
    E|p^_i - p_i| <= sqrt(p_i (1 - p_i) / n)), plus McDiarmid's deviation sqrt(ln(1/delta) / (2n)) (one draw moves
    TV by at most 1/n)."""
    return 0.5 * math.sqrt((cells - 1) / n) + math.sqrt(math.log(1 / delta) / (2 * n))


def _tv(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


def test_first_token_follows_the_hot_softmax_and_the_second_the_normal_one(policy):
    model, processor = policy
    prompt = _prompt(processor)
    ids = prompt.input_ids.tolist()
    engine = make_engine("hf", model, processor)
    torch.manual_seed(0)
    sampling = SamplingParams(n=N, temperature=T, top_k=TOP_K, max_new_tokens=2, first_token_temperature=T_FIRST)
    rollouts = engine.generate([prompt], sampling)
    assert len(rollouts) == N

    # the first token: hot, top-k filtered
    l0 = _next_logits(model, processor, ids)
    hot, cold = _drawn_from(l0, T_FIRST, TOP_K), _drawn_from(l0, T, TOP_K)
    firsts = torch.tensor([int(x.response_ids[0]) for x in rollouts])
    seen = {int(k): c / N for k, c in zip(*torch.unique(firsts, return_counts=True))}
    p_hot = {k: float(hot[k]) for k in hot.nonzero().flatten().tolist()}
    bound1 = tv_bound(TOP_K, N)  # 0.051
    tv1 = _tv(seen, p_hot)
    assert tv1 < bound1, (tv1, bound1)
    assert set(seen) <= set(p_hot)  # top-k filtered the hot draw
    assert _tv(p_hot, {k: float(cold[k]) for k in p_hot}) > 5 * bound1  # without FIRE it would fail

    # the pair: hot first token, then the normal temperature given it (EOS first: the response ends there)
    eos = set(engine.eos_ids)
    joint, joint_all_hot, logp_ref = {}, {}, {}
    for first, p1 in p_hot.items():
        if first in eos:
            joint[(first,)] = joint_all_hot[(first,)] = p1
            continue
        l1 = _next_logits(model, processor, ids + [first])
        q, q_hot = _drawn_from(l1, T, TOP_K), _drawn_from(l1, T_FIRST, TOP_K)
        for second in q.nonzero().flatten().tolist():
            joint[(first, second)] = p1 * float(q[second])
            logp_ref[(first, second)] = (math.log(p1), math.log(float(q[second])))
        for second in q_hot.nonzero().flatten().tolist():
            joint_all_hot[(first, second)] = p1 * float(q_hot[second])
    pairs = [tuple(x.response_ids.tolist()) for x in rollouts]
    seen2: dict[tuple, float] = {}
    for pair in pairs:
        seen2[pair] = seen2.get(pair, 0.0) + 1 / N
    bound2 = tv_bound(len(joint), N)  # 64 cells: 0.092
    tv2 = _tv(seen2, joint)
    assert tv2 < bound2, (tv2, bound2)
    assert _tv(joint, joint_all_hot) > 3 * bound2  # a second token drawn hot too would fail

    # each drawn token's reported log-prob is its distribution's: the first hot, the second normal (top-k kept)
    for x, pair in zip(rollouts, pairs):
        if len(pair) == 2:
            assert x.logprobs.shape == (2,)
            assert torch.allclose(x.logprobs.double(), torch.tensor(logp_ref[pair], dtype=torch.float64), atol=1e-5)


HF_PATHS = {
    "module, prefill once": dict(hf=HFEngineConfig(inference_copy="off", compile="off")),
    "module, prompts repeated": dict(hf=HFEngineConfig(inference_copy="off", compile="off"), prefill_once=False),
    "module, static cache": dict(hf=HFEngineConfig(inference_copy="off", compile="on")),
    "inference copy": dict(hf=HFEngineConfig(inference_copy="on", dtype="float32", compile="off")),
    "inference copy, static cache": dict(hf=HFEngineConfig(inference_copy="on", dtype="float32", compile="on")),
}


@pytest.mark.parametrize("path", list(HF_PATHS))
def test_every_hf_path_reports_the_log_prob_of_the_distribution_it_drew_from(policy, path):
    model, processor = policy
    spec = dict(HF_PATHS[path])
    prefill_once = spec.pop("prefill_once", True)
    engine = make_engine("hf", model, processor, **spec)
    engine.prefill_once = prefill_once
    prompt = _prompt(processor)
    torch.manual_seed(1)
    rollouts = engine.generate(
        [prompt], SamplingParams(n=6, temperature=0.7, max_new_tokens=4, first_token_temperature=3.0)
    )
    checked = 0
    for x in rollouts:
        whole = torch.cat([prompt.input_ids, x.response_ids])[None]
        with torch.no_grad():
            logits = model(input_ids=whole, attention_mask=torch.ones_like(whole)).logits[0].double()
        logits[:, vision_token_ids(tokenizer_of(processor))] = -math.inf
        start = prompt.input_ids.numel() - 1
        temps = torch.tensor([3.0] + [0.7] * (x.response_ids.numel() - 1), dtype=torch.float64)[:, None]
        step_logits = logits[start : start + x.response_ids.numel()]
        ref = torch.log_softmax(step_logits / temps, -1).gather(-1, x.response_ids[:, None]).squeeze(-1)
        normal = torch.log_softmax(step_logits[0] / 0.7, -1)[x.response_ids[0]]
        assert torch.allclose(x.logprobs.double(), ref, atol=1e-5), (path, x.logprobs, ref)
        assert abs(float(ref[0] - normal)) > 1e-2  # the first token's log-prob is the hot one, not the normal one
        checked += x.response_ids.numel()
    assert checked >= 12


def test_only_the_first_turn_of_a_trajectory_starts_hot(tool_policy):
    from data_pipelines.collate import processor_image_kwargs
    from data_pipelines.synthetic import make_prompt_records
    from vlrft.rollout.trajectories import TrajectoryRunner
    from vlrft.tools import ToolBox, ToolsConfig

    model, processor = load_model(tool_policy, "float32")
    model.eval()
    cfg = ToolsConfig(names=["zoom"], max_turns=3, max_tokens=256)
    box = ToolBox(cfg, processor_image_kwargs(processor))
    t, t_first = 0.5, 1.5
    try:
        runner = TrajectoryRunner(make_engine("hf", model, processor), processor, box, cfg)
        records = make_prompt_records("mark_color", 2, seed=7, image_size=256)
        prompts = [encode_prompt(processor, r, tools=box.schemas) for r in records]
        torch.manual_seed(0)
        sampling = SamplingParams(n=4, temperature=t, top_k=4, max_new_tokens=32, first_token_temperature=t_first)
        rollouts = runner.run(records, prompts, sampling)
    finally:
        box.close()
    multi = [x for x in rollouts if len(x.trajectory.turns) >= 2]
    assert multi, [x.trajectory.turns for x in rollouts]
    suppress = vision_token_ids(tokenizer_of(processor))
    for x in multi:
        prompt = prompts[x.prompt_index]
        batch = collate_prompts([concat([prompt, x.trajectory.response])], tokenizer_of(processor).pad_token_id)
        with torch.no_grad():
            logits = model(**batch).logits[0].double()
        logits[:, suppress] = -math.inf
        P, mask = prompt.input_ids.numel(), x.trajectory.action_mask.bool()
        step_logits = logits[P - 1 : P - 1 + x.response_ids.numel()]
        temps = torch.full((x.response_ids.numel(), 1), t, dtype=torch.float64)
        temps[0] = t_first
        ref = torch.log_softmax(_top_k(step_logits / temps, 4), -1).gather(-1, x.response_ids[:, None]).squeeze(-1)
        assert torch.allclose(x.logprobs.double()[mask], ref[mask], atol=1e-5)
        # each later turn's first token: drawn at the normal temperature, which differs from the hot one there
        starts = [j for j in range(1, mask.numel()) if mask[j] and not mask[j - 1]]
        assert starts
        for j in starts:
            hot = torch.log_softmax(_top_k(step_logits[j] / t_first, 4), -1)[x.response_ids[j]]
            assert abs(float(hot - ref[j])) > 1e-3


def _top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    kth = scores.topk(k, -1).values[..., -1:]
    return scores.masked_fill(scores < kth, -math.inf)


@pytest.mark.parametrize("value", ["0", "-1.5"])
def test_a_non_positive_first_token_temperature_is_one_line(value):
    with pytest.raises(ConfigError) as err:
        load_config(PolicyTrainConfig, None, [f"rollout.first_token_temperature={value}"])
    assert str(err.value) == f"rollout.first_token_temperature={float(value)}: must be > 0"
    cfg = load_config(PolicyTrainConfig, None, ["rollout.first_token_temperature=2.5"])
    assert cfg.rollout.sampling().first_token_temperature == 2.5 and cfg.rollout.sampling().logprobs
    default = load_config(PolicyTrainConfig, None, [])
    assert default.rollout.first_token_temperature is None and not default.rollout.sampling().logprobs
    with pytest.raises(ValueError, match="FIRE samples, both must be > 0"):
        SamplingParams(temperature=0.0, first_token_temperature=2.0)
    # vLLM refuses a temperature above 2 at its first request: before anything loads instead
    with pytest.raises(ConfigError) as err:
        load_config(PolicyTrainConfig, None, ["rollout.first_token_temperature=2.5", "rollout.engine=vllm"])
    assert str(err.value) == (
        "rollout.first_token_temperature=2.5: rollout.engine=vllm samples at temperatures in [0, 2]; use 2 or less, "
        "or rollout.engine=hf"
    )
    load_config(PolicyTrainConfig, None, ["rollout.first_token_temperature=2", "rollout.engine=vllm"])


def test_a_fire_step_corrects_the_first_token_and_leaves_held_out_evaluation_alone(tiny_model, tmp_path):
    from data_pipelines.synthetic import make_prompt_records
    from reward_models.pool import RewardPool
    from vlrft.loop import training_run
    from vlrft.trainer.heldout import heldout_eval
    from vlrft.trainer.policy_trainer import PolicyTrainer

    overrides = [
        "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=4",
        "rollout.temperature=0.5",
        "rollout.first_token_temperature=4.0",
        "algorithm.rollout_correction=token_tis",
        "train.eval_temperature=0.7",  # sampled, seeded: FIRE leaking into it would change the responses
        "train.eval_n=4",
        "data.synthetic_train_size=8",
        "logging.tensorboard=false",
        "logging.wandb=disabled",
        f"train.output_dir={tmp_path / 'run'}",
    ]
    cfg = load_config(PolicyTrainConfig, None, overrides)
    model, processor = load_model(str(tiny_model("qwen2_5_vl")))
    with training_run(cfg, "train-policy") as run:
        trainer = PolicyTrainer(
            cfg,
            run.strategy,
            model,
            processor,
            make_prompt_records("color", 8, seed=0),
            RewardPool(cfg.reward),
            eval_records=make_prompt_records("color", 4, seed=1),
            accuracy=("accuracy", "vocab_answer"),
            total_steps=1,
            guard=run.guard,
        )
        with_fire = heldout_eval(trainer)
        cfg.rollout.first_token_temperature = None
        without = heldout_eval(trainer)
        cfg.rollout.first_token_temperature = 4.0
        metrics = trainer.step(1)
    assert json.dumps(with_fire, sort_keys=True) == json.dumps(without, sort_keys=True)
    # the engine's log-probs (first token at 4.0) against the trainer's (all at 0.5): the first token is off-policy
    assert metrics["rollout/logprob_diff_max"] > 0.1
    assert metrics["rollout/is_weight_mean"] != 1.0


def test_a_stop_string_across_the_hot_token_and_its_continuation_is_cut(policy):
    _, processor = policy
    tok = tokenizer_of(processor)
    ids = [tok.convert_tokens_to_ids(t) for t in ("<", "/", "a", "n")]
    assert tok.decode(ids) == "</an"
    assert _straddling_stop(tok, ids, ["</"]) == 2  # begins in the first token, ends in the continuation
    assert _straddling_stop(tok, ids, ["/a"]) == 3  # within reach of the first token: the same cut vLLM makes
    assert _straddling_stop(tok, ids, ["<"]) is None  # in the first token alone: its own request stopped there
    assert _straddling_stop(tok, ids, ["an"]) is None  # past reach: the continuation's request stopped there
    assert _straddling_stop(tok, ids, []) is None


@pytest.mark.vllm
def test_vllm_draws_the_first_token_hot_and_reports_each_log_prob_as_drawn(tiny_model):
    pytest.importorskip("vllm", reason="vLLM is not installed here: bash scripts/setup.sh --vllm")
    from vlrft.rollout import VLLMRolloutEngine

    path = tiny_model("qwen2", hidden=128, heads=2, kv_heads=2)  # head_dim 64: vLLM refuses 16
    model, processor = load_model(str(path), "float32")
    model.eval()
    engine = VLLMRolloutEngine(str(path), processor)
    prompt = _prompt(processor)
    ids = prompt.input_ids.tolist()
    n = 2000
    sampling = SamplingParams(n=n, temperature=T, top_k=TOP_K, max_new_tokens=2, first_token_temperature=T_FIRST)
    rollouts = engine.generate([prompt], sampling)
    assert len(rollouts) == n and all(x.logprobs is not None for x in rollouts)
    l0 = _next_logits(model, processor, ids)
    hot, cold = _drawn_from(l0, T_FIRST, TOP_K), _drawn_from(l0, T, TOP_K)
    p_hot = {k: float(hot[k]) for k in hot.nonzero().flatten().tolist()}
    firsts = [int(x.response_ids[0]) for x in rollouts]
    seen = {k: firsts.count(k) / n for k in set(firsts)}
    bound = tv_bound(TOP_K, n)  # 0.071
    assert _tv(seen, p_hot) < bound
    assert _tv(p_hot, {k: float(cold[k]) for k in p_hot}) > 2 * bound  # without FIRE it would fail
    for x in rollouts[:200]:  # each token's log-prob as drawn (vLLM's processed log-probs: after top-k)
        first = int(x.response_ids[0])
        assert abs(float(x.logprobs[0]) - math.log(p_hot[first])) < 1e-4
        if x.response_ids.numel() == 2:
            q = _drawn_from(_next_logits(model, processor, ids + [first]), T, TOP_K)
            assert abs(float(x.logprobs[1]) - math.log(float(q[x.response_ids[1]]))) < 1e-4
    one = engine.generate([prompt], SamplingParams(n=4, temperature=T, max_new_tokens=1, first_token_temperature=2.0))
    assert all(x.response_ids.numel() == 1 for x in one)  # the hot request alone
