"""``vlrft serve-reward-model [CONFIG.yaml] [source.key=value ...]``: one reward source served over HTTP."""

from __future__ import annotations

import argparse

from vlrft.commands import ConfigHelp, config_from_args, config_help


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve-reward-model",
        help="serve a reward source (verifier, SRM, judge, function) over HTTP for kind: http sources",
        description="Serve the reward source of CONFIG (a YAML file with a 'source:' section) and/or overrides "
        "such as source.kind=srm source.path=runs/srm/final source.name=rm, over HTTP: POST /score scores "
        "samples, GET /health describes the source, POST /verify grades (a source that grades on its own). "
        "Prints 'serving reward source NAME (KIND) on http://HOST:PORT' once the source is loaded, and serves "
        "until SIGTERM or Ctrl-C. Requests arriving within --batch-window-ms are scored together, in calls of at "
        "most --max-batch-size samples. See docs/reward-models.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    p.add_argument("-h", "--help", action=ConfigHelp, epilog=_epilog)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8100, help="port to listen on (default 8100; 0: any free port)")
    p.add_argument("--max-batch-size", type=int, default=64, help="most samples per scoring call (default 64)")
    p.add_argument(
        "--batch-window-ms",
        type=float,
        default=10.0,
        help="requests arriving within this window are scored together (default 10)",
    )
    p.add_argument("--device", default="auto", help="scoring device: auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--num-threads", type=int, default=4, help="threads for verifiers and image decoding (default 4)")
    p.add_argument(
        "--api-key-env",
        default="",
        metavar="NAME",
        help="require 'Authorization: Bearer KEY' on /score and /verify, KEY being this environment variable's value "
        "(clients: the source's api_key_env); default: no key, for loopback or a trusted network",
    )
    p.add_argument(
        "--image-root",
        default="",
        metavar="DIR",
        help="also read images given as paths, only files under DIR (relative paths start there; default: data URIs "
        "only, what clients send)",
    )
    p.add_argument("--allow-local-images", action="store_true", help="(kept for old scripts: needs --image-root)")
    p.add_argument(
        "--max-request-mib", type=int, default=256, help="largest request body in MiB (default 256; images inline)"
    )
    p.add_argument(
        "--max-request-pixels",
        type=int,
        default=100_000_000,
        help="most image pixels (width x height, summed over a request's distinct images) decoded for one request "
        "(default 100000000); more is a 413. Only for a source that reads images: a verifier decodes none",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="close a connection that sends nothing for this long (idle, mid-headers or mid-body; default 30)",
    )
    p.add_argument(
        "items", nargs="*", metavar="[CONFIG.yaml] [source.key=value ...]", help="the source's config and overrides"
    )
    p.set_defaults(func=run)


def _epilog() -> str:
    from reward_models.serve import ServeConfig

    return config_help(ServeConfig, None)


def run(args: argparse.Namespace) -> int:
    import ipaddress
    import os
    import sys
    from pathlib import Path

    from reward_models.serve import RewardServer, ServeConfig, listen, serve
    from reward_models.serve_requests import Limits
    from vlrft.config import ConfigError

    for flag, value, low in (
        ("--port", args.port, 0),
        ("--max-batch-size", args.max_batch_size, 1),
        ("--max-request-mib", args.max_request_mib, 1),
        ("--max-request-pixels", args.max_request_pixels, 1),
    ):
        if value < low or (flag == "--port" and value > 65535):
            raise ConfigError(f"{flag}={value}: must be >= {low}" + (" and <= 65535" if flag == "--port" else ""))
    if not args.batch_window_ms >= 0:
        raise ConfigError(f"--batch-window-ms={args.batch_window_ms}: must be >= 0")
    if not 0 < args.read_timeout < float("inf"):
        raise ConfigError(f"--read-timeout={args.read_timeout}: must be > 0 seconds")
    if args.allow_local_images and not args.image_root:
        raise ConfigError(
            "--allow-local-images: give --image-root DIR instead (the folder whose image files this server may "
            "read; paths outside it are refused)"
        )
    root = Path(args.image_root).expanduser().resolve() if args.image_root else None
    if root is not None and not root.is_dir():
        raise ConfigError(f"--image-root={args.image_root}: not a directory")
    key = os.environ.get(args.api_key_env, "") if args.api_key_env else ""
    if args.api_key_env and not key:
        raise ConfigError(f"--api-key-env={args.api_key_env}: the environment variable is not set or empty")
    cfg = config_from_args(ServeConfig, args.items)  # (the config is checked before a warning is printed)
    try:
        loopback = args.host == "localhost" or ipaddress.ip_address(args.host).is_loopback
    except ValueError:  # a host name
        loopback = False
    with listen(args.host, args.port) as sock:  # before the source loads: a busy port fails at once
        if not key and not loopback:
            print(
                f"warning: serving on {args.host} without --api-key-env: anyone who reaches this port can use the "
                "source",
                file=sys.stderr,
                flush=True,
            )
        limits = Limits(args.max_request_mib, args.read_timeout, args.max_request_pixels, root)
        server = RewardServer(
            cfg.source,
            args.device,
            args.max_batch_size,
            args.batch_window_ms / 1000,
            args.num_threads,
            api_key=key,
            limits=limits,
        )
        try:
            serve(server, sock)
        finally:
            server.close()
    return 0
