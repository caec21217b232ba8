"""Tiny, randomly initialised Qwen models built from config, with a locally trained tokenizer.

``make_tiny_model(out_dir, arch=...)`` writes a folder that the Auto classes reload exactly as they
would a hub checkpoint: ``config.json`` + ``model.safetensors``, a byte-level BPE tokenizer with Qwen's
special tokens (in Qwen's order, after the BPE vocabulary) and Qwen-VL's chat template, and for the
vision-language architectures an image processor and a processor that work without torchvision.
Nothing is downloaded; the same arguments give the same bytes.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    Qwen2_5_VLConfig,
    Qwen2Config,
    Qwen2Tokenizer,
    Qwen2VLConfig,
    Qwen2VLImageProcessorPil,
    Qwen3Config,
)

from data_pipelines.templates import tools_system_text
from vlrft.archs import ARCHS, TEXT_ARCHS
from vlrft.models.processing import (
    ImageOnlyQwen2_5_VLProcessor,
    ImageOnlyQwen2VLProcessor,
    ImageOnlyQwen3VLProcessor,
)
from vlrft.tools.builtin import BUILTIN_TOOLS

try:
    from transformers import Qwen3VLConfig
except ImportError:  # transformers without Qwen3-VL
    Qwen3VLConfig = None
try:
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3VLMoeConfig
except ImportError:  # transformers without Qwen3.5 (5.2+) or Qwen3-VL-MoE
    Qwen3_5Config = Qwen3_5MoeConfig = Qwen3VLMoeConfig = None


# Qwen's special tokens, in Qwen's order.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen's tool markup tokens (Qwen2.5: <tool_call>, </tool_call>; Qwen3: <tool_response>, </tool_response> too): added,
# not special, so a decoded response keeps them. Only tiny models built for tool use (``tool_tokens=True``) have them.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# Qwen2's pre-tokenizer split: single digits, letters runs, punctuation runs, whitespace.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2-VL's chat template (a plain string content works too, so text-only Qwen2 uses it as well), with the tool
# support of Qwen2.5's template: given ``tools``, the system turn lists their schemas in <tools></tools> and says how
# to call them (<tool_call>{"name": ..., "arguments": {...}}</tool_call>); consecutive ``tool`` messages become one
# user turn of <tool_response> blocks whose image parts are rendered as in any other turn (as Qwen3-VL's template
# does). Without tools and tool messages it renders exactly what Qwen2-VL's template renders.
_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
)
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{% set message = messages[0] %}" + _CONTENT + "{% else %}"
    "You are a helpful assistant.{% endif %}"
    # Jinja drops the first newline after a block tag (trim_blocks): newlines there are written as {{ '\\n' }}
    "{{ '\\n\\n' }}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' and not tools %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>{{ '\\n' }}" + _CONTENT + "{{ '\\n' }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif not (tools and loop.first and message['role'] == 'system') %}"
    "<|im_start|>{{ message['role'] }}\n" + _CONTENT + "<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Image bounds that give 4-16 LLM tokens per image (patch 14, merge 2: one token per 28x28 pixels).
MIN_PIXELS, MAX_PIXELS = 3136, 12544

_WORDS = (
    "the a an of to and in is it that for on with as was at by this be are from or have not what how many "
    "which who when where why there their they he she his her its one two three four five six seven eight "
    "nine ten eleven twelve twenty hundred thousand half twice each every total more less than equal sum "
    "difference product times divided plus minus per cent percent dollars cents hours minutes days weeks "
    "years apples books pages students friends money cost price sells buys gives gets has had left remaining "
    "answer question image picture shows show see look count number numbers colour color shape shapes red "
    "green blue yellow orange purple black white gray brown pink circle circles square squares triangle "
    "triangles rectangle star cross line lines angle angles degrees side sides length width height area "
    "perimeter radius diameter point points segment parallel perpendicular right acute obtuse find value "
    "measure x y z m n A B C D E F G H J K solve step first then next so therefore because let think "
    "reasoning final put box boxed inside only word letter choice choices option correct wrong yes no "
    "user assistant system helpful you are I we can will would should please respond reply with in the "
    "following format object objects small large big many few most least left right top bottom middle"
).split()


def _tool_lines(num_lines: int = 3000) -> list[str]:
    """Tool calls and responses in Qwen's markup, for the tokenizer of tiny models built for tool use (JSON keys,
    tool names and arguments then take a few tokens each, as in a real Qwen tokenizer)."""
    rng = random.Random(4321)
    regions = ("top_left", "top_right", "bottom_left", "bottom_right", "center", "top", "bottom", "left", "right")
    calls = (
        lambda: {"name": "zoom", "arguments": {"region": rng.choice(regions)}},
        lambda: {"name": "crop", "arguments": {"box": [rng.randint(0, 200) for _ in range(4)], "image": 1}},
        lambda: {"name": "rotate", "arguments": {"degrees": rng.choice((90, 180, 270)), "image": 1}},
        lambda: {"name": "calculator", "arguments": {"expression": f"{rng.randint(0, 99)} * {rng.randint(1, 9)}"}},
    )
    lines = []
    for _ in range(num_lines):
        call = json.dumps(rng.choice(calls)())
        lines.append(f"<tool_call>\n{call}\n</tool_call>")
        lines.append(f"<tool_response>\n{rng.randint(0, 999)}\n</tool_response>")
    schemas = [t.schema for t in BUILTIN_TOOLS.values()]
    for _ in range(num_lines // 6):  # the system text that lists tools, as a real tokenizer has seen it often
        lines.append(tools_system_text(None, rng.sample(schemas, rng.randint(1, len(schemas)))))
    return lines


def _corpus(num_lines: int = 6000, tools: bool = False) -> list[str]:
    """A deterministic text corpus covering the words, numbers and markup of our tasks (``tools``: and tool calls)."""
    rng = random.Random(1234)
    lines = _tool_lines() if tools else []
    for i in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 18))]
        num = str(rng.randint(0, 10 ** rng.randint(1, 4)))
        kind = i % 6
        if kind == 0:
            lines.append(" ".join(words).capitalize() + f"? The answer is {num}.")
        elif kind == 1:
            lines.append(f"<think>{' '.join(words)}</think> \\boxed{{{num}}}")
        elif kind == 2:
            lines.append(f"{' '.join(words)} {num} + {rng.randint(0, 99)} = {rng.randint(0, 999)}\n#### {num}")
        elif kind == 3:
            lines.append(f"\\angle {rng.choice('ABC')}{rng.choice('DEF')} = {num}^\\circ, \\frac{{{num}}}{{2}}")
        elif kind == 4:
            lines.append(f"The image shows {num} {rng.choice(_WORDS)} {rng.choice(_WORDS)}. " + " ".join(words))
        else:
            lines.append(" ".join(w.upper() if rng.random() < 0.1 else w for w in words) + ", " + num + ".")
    return lines


@lru_cache(maxsize=4)
def _trained_bpe(vocab_size: int, tools: bool = False) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a byte-level BPE on the corpus; returns (vocab, merges) without special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(tools=tools), trainer=trainer)
    state = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    return dict(state["vocab"]), merges


def build_tokenizer(vocab_size: int = 1024, tool_tokens: bool = False) -> Qwen2Tokenizer:
    """A Qwen2Tokenizer with a locally trained BPE vocabulary followed by Qwen's special tokens (``tool_tokens``: then
    Qwen's tool markup tokens, with tool calls in the BPE corpus; the total stays ``vocab_size``)."""
    extra = TOOL_TOKENS if tool_tokens else ()
    bpe_vocab, merges = _trained_bpe(vocab_size - len(SPECIAL_TOKENS) - len(extra), tool_tokens)
    vocab = dict(sorted(bpe_vocab.items(), key=lambda kv: kv[1]))
    for token in SPECIAL_TOKENS + extra:  # ids right after the BPE vocabulary, in Qwen's order
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=list(merges),
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        errors="replace",
        add_prefix_space=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    if extra:  # matched whole, decoded even with skip_special_tokens (Qwen's added, non-special tokens)
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 32768
    return tokenizer


@dataclass
class TinySpec:
    """Sizes of a tiny model (defaults: 64 hidden, 2 layers, 4 heads / 2 KV heads, vision depth 2)."""

    arch: str = "qwen2_5_vl"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vision_depth: int = 2
    vision_hidden: int = 64
    vocab_size: int = 1024
    seed: int = 0
    tool_tokens: bool = False  # Qwen's tool markup tokens and tool calls in the tokenizer's corpus (tool use)


def _text_kwargs(spec: TinySpec, vocab: int, ids: dict[str, int], mrope: bool) -> dict:
    head_dim = spec.hidden // spec.heads
    if head_dim % 2 or spec.hidden % spec.heads:
        raise ValueError(f"--hidden {spec.hidden} must be divisible by 2 * heads ({spec.heads})")
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0}
    if mrope:  # temporal, height, width sections; they must sum to head_dim / 2
        half = head_dim // 2
        rope["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
    return dict(
        vocab_size=vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.hidden * 2,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=4096,
        rope_parameters=rope,
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )


def build_config(spec: TinySpec, tokenizer: Qwen2Tokenizer):
    """The transformers config of a tiny model of ``spec.arch``."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab = len(tokenizer)
    if spec.arch == "qwen2":
        return Qwen2Config(**_text_kwargs(spec, vocab, ids, mrope=False))
    if spec.arch == "qwen3":  # Qwen3's q/k norms; its head size is a config value (128 by default), set to the split
        return Qwen3Config(**_text_kwargs(spec, vocab, ids, mrope=False), head_dim=spec.hidden // spec.heads)
    special = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    text = _text_kwargs(spec, vocab, ids, mrope=True)
    vh, depth = spec.vision_hidden, spec.vision_depth
    if spec.arch == "qwen2_vl":
        vision = dict(
            depth=depth,
            embed_dim=vh,
            hidden_size=spec.hidden,
            num_heads=4,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        )
        return Qwen2VLConfig(text_config=text, vision_config=vision, **special)
    if spec.arch == "qwen2_5_vl":
        vision = _vision_tower(spec, patch_size=14, fullatt_block_indexes=[depth - 1], window_size=56)
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **special)
    if spec.arch in QWEN3_FAMILY:
        return _qwen3_family_config(spec, text, special)
    raise ValueError(f"unknown arch {spec.arch!r}; choose one of {', '.join(ARCHS)}")


# the Qwen3-VL family (patch 16, Qwen3-VL's vision tower): the arch -> its config class
QWEN3_FAMILY = {
    "qwen3_vl": Qwen3VLConfig,
    "qwen3_vl_moe": Qwen3VLMoeConfig,
    "qwen3_5": Qwen3_5Config,
    "qwen3_5_moe": Qwen3_5MoeConfig,
}


def _vision_tower(spec: TinySpec, **own: Any) -> dict:
    """The vision config of Qwen2.5-VL's and Qwen3-VL's towers (``hidden_size`` their width, ``out_hidden_size`` the
    LLM's), with each family's ``own`` keys (patch size, windows, position embeddings)."""
    common = dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=spec.vision_hidden * 2)
    common.update(num_heads=4, out_hidden_size=spec.hidden, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    return {**common, **own}


def _qwen3_family_config(spec: TinySpec, text: dict, special: dict):
    """Qwen3-VL (dense / MoE) and Qwen3.5 (dense / MoE): Qwen3-VL's vision tower (Qwen3.5's without deepstack), its
    interleaved m-rope; MoE: 4 experts, top-2 routing (Qwen3.5-MoE also a shared expert); Qwen3.5: Gated DeltaNet
    linear-attention layers, full attention every 4th layer and in the last (so 2 layers are one of each), the
    rotary embedding on half of each head (Qwen3.5's 0.25 of 256 dims would leave a tiny head 2 rotary pairs)."""
    head_dim = spec.hidden // spec.heads
    text["head_dim"] = head_dim
    text["rope_parameters"]["mrope_interleaved"] = True
    vision = _vision_tower(spec, patch_size=16, num_position_embeddings=256)
    if spec.arch.startswith("qwen3_vl"):
        vision["deepstack_visual_indexes"] = [0]
    if spec.arch.endswith("moe"):
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=spec.hidden)
    if spec.arch == "qwen3_vl_moe":  # transformers' router always renormalizes the top-k; vLLM reads the flag
        text["norm_topk_prob"] = True
    if spec.arch == "qwen3_5_moe":
        text["shared_expert_intermediate_size"] = spec.hidden
    if spec.arch.startswith("qwen3_5"):
        half = head_dim // 4  # rotary pairs on half of the head, in temporal / height / width sections
        text["rope_parameters"].update(
            partial_rotary_factor=0.5, mrope_section=[half - 2 * (half // 3)] + [half // 3] * 2
        )
        text.update(
            layer_types=[
                "full_attention" if (i + 1) % 4 == 0 or i == spec.layers - 1 else "linear_attention"
                for i in range(spec.layers)
            ],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=head_dim,
            linear_value_head_dim=head_dim,
            linear_num_key_heads=spec.kv_heads,
            linear_num_value_heads=spec.heads,
        )
    return QWEN3_FAMILY[spec.arch](text_config=text, vision_config=vision, **special)


def build_image_processor(arch: str) -> Qwen2VLImageProcessorPil:
    """A PIL-backed Qwen-VL image processor bounded to 4-16 LLM tokens per image."""
    if arch in QWEN3_FAMILY:  # patch 16, merge 2: one token per 32x32 pixels
        return Qwen2VLImageProcessorPil(
            size={"shortest_edge": 4 * 32 * 32, "longest_edge": 16 * 32 * 32},
            patch_size=16,
            temporal_patch_size=2,
            merge_size=2,
            image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5],
        )
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )


# transformers builds Qwen3-VL's processor for every arch of the Qwen3 family
_PROCESSORS = {"qwen2_vl": ImageOnlyQwen2VLProcessor, "qwen2_5_vl": ImageOnlyQwen2_5_VLProcessor}
_PROCESSORS.update(dict.fromkeys(QWEN3_FAMILY, ImageOnlyQwen3VLProcessor))


def make_tiny_model(out_dir: str | Path, arch: str = "qwen2_5_vl", **sizes) -> Path:
    """Write a tiny randomly initialised model of ``arch`` (plus tokenizer/processor) to ``out_dir``."""
    spec = TinySpec(arch=arch, **sizes)
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size, spec.tool_tokens)
    config = build_config(spec, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        auto = AutoModelForCausalLM if arch in TEXT_ARCHS else AutoModelForImageTextToText
        model = auto.from_config(config, dtype=torch.float32)
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = config.get_text_config().eos_token_id
    model.generation_config.pad_token_id = config.get_text_config().pad_token_id
    model.save_pretrained(out)
    if arch in TEXT_ARCHS:
        tokenizer.save_pretrained(out)
    else:
        processor = _PROCESSORS[arch](build_image_processor(arch), tokenizer, chat_template=CHAT_TEMPLATE)
        processor.save_pretrained(out)
    (out / "vlrft_tiny.json").write_text(json.dumps(spec.__dict__, indent=2, sort_keys=True) + "\n")
    return out


def initial_model_path(model_cfg: Any, out: Path, strategy: Any, seed: int, tool_tokens: bool = False) -> str:
    """``model_cfg.path``, or (empty) a tiny random model written once to ``out/initial-model`` from
    ``model_cfg.tiny_*`` and ``seed`` (``tool_tokens``: with Qwen's tool markup tokens, for runs with tools): rank 0
    writes it (same seed, same bytes), all ranks wait."""
    if model_cfg.path:
        return model_cfg.path
    path = Path(out) / "initial-model"
    if strategy.is_rank0 and not (path / "config.json").is_file():
        make_tiny_model(
            path,
            arch=model_cfg.tiny_arch,
            hidden=model_cfg.tiny_hidden,
            layers=model_cfg.tiny_layers,
            seed=seed,
            tool_tokens=tool_tokens,
        )
    strategy.barrier()
    return str(path)
