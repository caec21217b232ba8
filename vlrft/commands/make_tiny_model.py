"""``vlrft make-tiny-model``: write a tiny randomly initialised Qwen(-VL) model folder."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from vlrft.archs import ARCHS

    d = argparse.Namespace(
        arch="qwen2_5_vl",
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        vision_depth=2,
        vision_hidden=64,
        vocab_size=1024,
        seed=0,
        tool_tokens=False,
    )  # = TinySpec's defaults (tested)
    p = sub.add_parser(
        "make-tiny-model",
        help="write a tiny random Qwen-VL/Qwen model with a local tokenizer (no download)",
        description="Write a real, randomly initialised model of ARCH with a locally trained byte-level BPE "
        "tokenizer (Qwen special tokens, Qwen-VL chat template) and, for VL archs, an image processor and "
        "processor that work without torchvision. The Auto classes reload the folder. Same seed, same bytes.",
    )
    p.add_argument("out_dir", help="folder to write (created if missing)")
    p.add_argument("--arch", default=d.arch, choices=ARCHS, help=f"architecture (default {d.arch})")
    p.add_argument("--hidden", type=int, default=d.hidden, help=f"LLM hidden size (default {d.hidden})")
    p.add_argument("--layers", type=int, default=d.layers, help=f"LLM decoder layers (default {d.layers})")
    p.add_argument("--heads", type=int, default=d.heads, help=f"attention heads (default {d.heads})")
    p.add_argument("--kv-heads", type=int, default=d.kv_heads, help=f"key/value heads (default {d.kv_heads})")
    p.add_argument("--vision-depth", type=int, default=d.vision_depth, help=f"vision blocks (default {d.vision_depth})")
    p.add_argument(
        "--vision-hidden", type=int, default=d.vision_hidden, help=f"vision width (default {d.vision_hidden})"
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=d.vocab_size,
        help=f"tokenizer size incl. special tokens (default {d.vocab_size})",
    )
    p.add_argument("--seed", type=int, default=d.seed, help=f"initialisation seed (default {d.seed})")
    p.add_argument(
        "--tool-tokens",
        action="store_true",
        help="Qwen's tool tokens (<tool_call> ...) and tool calls in the tokenizer's corpus (docs/tools.md)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vlrft.models.tiny import make_tiny_model

    out = make_tiny_model(
        args.out_dir,
        arch=args.arch,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vision_depth=args.vision_depth,
        vision_hidden=args.vision_hidden,
        tool_tokens=args.tool_tokens,
        vocab_size=args.vocab_size,
        seed=args.seed,
    )
    import math

    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        n = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    print(f"wrote tiny {args.arch} ({n / 1e6:.2f} M parameters) to {out}")
    return 0
