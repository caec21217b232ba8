"""``vlrft serve-reward-model`` under hostile use (issue 64): local images only under ``--image-root`` and a
failure that says nothing of the file; images decoded only for a source that reads them, within
``--max-request-pixels``; connections that stall or leave dropped after ``--read-timeout`` in one log line; a
busy port, an unknown host, a body nested too deeply and a field of the wrong type each one line. Every server is
a real ``vlrft serve-reward-model`` process (tests/reward_servers.py)."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import select
import socket
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image
from reward_servers import Served

from data_pipelines.synthetic import make_prompt_records
from reward_models.kinds import SOURCE_KINDS
from vlrft.cli import main

RED = {"id": "a", "prompt": "p", "response": "red", "answer": "red", "metadata": {"vocabulary": ["red"]}}
UNREADABLE = "samples[{}].images[0]: not a readable image (a regular image file under the server's image root)"
WIDTHS = "def score(sample):\n    return float(sum(im.size[0] for im in sample.images))\n"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """An image root holding an image, a link out of it, a fifo, a file over the size cap and a file that
    PIL's PPM reader quotes; beside it, files the server must not read."""
    base = tmp_path_factory.mktemp("serve")
    root = base / "images"
    root.mkdir()
    make_prompt_records("color", 1, seed=5)[0].images[0].save(root / "red.png")
    (base / "secret.png").write_bytes((root / "red.png").read_bytes())  # a good image, outside the root
    (base / "secret.txt").write_text("secret-in-plain-text\n")
    (root / "link.png").symlink_to(base / "secret.png")
    (root / "inside.png").symlink_to(root / "red.png")  # a link that stays inside: read
    os.mkfifo(root / "pipe.png")
    (root / "big.png").write_bytes(b"\x89PNG" + bytes(1 << 20))  # over --max-request-mib 1
    (root / "header.ppm").write_bytes(b"P6 secret-in-password-file 1 1\n")  # PIL: "Token too long ...: secret..."
    (root / "sub").mkdir()
    return root


@pytest.fixture(scope="module")
def served(root):
    limits = ("--image-root", str(root), "--max-request-mib", "1", "--read-timeout", "1")
    server = Served("source.verifier=vocab_answer", args=limits)
    yield server
    server.kill()


def _png_uri(width: int, height: int) -> str:
    """A 1-bit PNG of ``width`` x ``height``: 8000 x 8000 is 64 million pixels in 8 KB."""
    buf = io.BytesIO()
    Image.new("1", (width, height)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _peak_mib(pid: int) -> float:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) / 1024


def test_local_images_are_read_only_under_the_image_root_and_a_failure_quotes_nothing(served, root):
    """Paths out of the root (``..``, absolute, a link leading out, ``/proc``, ``/etc/shadow``), ``~``, a fifo,
    a folder, a missing file, a file over the cap and one whose bytes PIL's error would quote: the same reply,
    naming the sample, saying nothing of the file; the image under the root (directly or by a link inside) is read.
    The fifo does not hang the server."""
    paths = [
        "red.png",
        str(root / "inside.png"),
        "../secret.png",
        str(root.parent / "secret.png"),
        "link.png",
        "/proc/self/environ",
        "/etc/shadow",
        "~/secret.png",
        "pipe.png",
        "sub",
        "missing.png",
        "big.png",
        "header.ppm",
        "../secret.txt",
        "file://" + str(root.parent / "secret.txt"),
    ]
    samples = [{**RED, "id": str(i), "images": [p]} for i, p in enumerate(paths)]
    start = time.monotonic()
    with httpx.Client(timeout=60) as http:
        r = http.post(f"{served.url}/score", json={"samples": samples})
    assert time.monotonic() - start < 10
    assert r.status_code == 200
    assert r.json()["values"][:2] == [1.0, 1.0]
    assert r.json()["failed"] == {str(i): UNREADABLE.format(i) for i in range(2, len(paths))}
    assert "secret" not in r.text.replace("secret.png", "").replace("secret.txt", "")


def test_local_images_need_an_image_root_in_one_line(capsys, tmp_path):
    """--allow-local-images (the flag of earlier versions, which read any path) alone is refused, naming
    --image-root; a root that is no folder is one line too. Neither loads the source."""
    assert main(["serve-reward-model", "source.verifier=vocab_answer", "--allow-local-images"]) == 2
    assert capsys.readouterr().err == (
        "vlrft serve-reward-model: config error: --allow-local-images: give --image-root DIR instead (the folder "
        "whose image files this server may read; paths outside it are refused)\n"
    )
    missing = tmp_path / "nowhere"
    assert main(["serve-reward-model", "source.verifier=vocab_answer", "--image-root", str(missing)]) == 2
    assert capsys.readouterr().err == (
        f"vlrft serve-reward-model: config error: --image-root={missing}: not a directory\n"
    )


def test_a_verifier_decodes_no_image_and_a_source_that_reads_images_is_capped(served, tmp_path):
    """Six 8000 x 8000 PNGs (8 KB each, 384 million pixels): a verifier scores them without decoding them (before
    issue 64: +1.6 GB of peak memory and 5.5 s); a function that reads images gets 413 naming the cap and the
    figure, and the images' decoded sizes when under it."""
    assert {kind: cls.reads_images for kind, cls in SOURCE_KINDS.items()} == {
        "verifier": False,
        **dict.fromkeys(("srm", "grm", "function", "http", "openai_judge"), True),
    }
    big = [_png_uri(8000 - k, 8000) for k in range(6)]
    Path(f"/proc/{served.proc.pid}/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
    before = _peak_mib(served.proc.pid)
    start = time.monotonic()
    with httpx.Client(timeout=60) as http:
        r = http.post(f"{served.url}/score", json={"samples": [{**RED, "images": big}, {**RED, "images": big}]})
    took = time.monotonic() - start
    grew = _peak_mib(served.proc.pid) - before
    assert (r.status_code, r.json()) == (200, {"values": [1.0, 1.0], "failed": {}, "extras": {}})
    assert grew < 100, grew  # decoded, one of them alone is 192 MB of RGB
    assert took < 3, took
    reward = tmp_path / "widths.py"
    reward.write_text(WIDTHS)
    fn = Served("source.kind=function", f"source.function={reward}:score", "source.isolation=inline")
    try:
        with httpx.Client(timeout=60) as http:
            r = http.post(f"{fn.url}/score", json={"samples": [{**RED, "images": big}]})
            assert (r.status_code, r.text) == (
                413,
                "the request's 6 images hold 383,880,000 pixels (width x height, summed over distinct images) > "
                "--max-request-pixels 100,000,000; send fewer samples per request (the source's http_batch_size) "
                "or smaller images",
            )
            small = {**RED, "images": [_png_uri(300, 20), _png_uri(40, 20)]}
            r = http.post(f"{fn.url}/score", json={"samples": [small, small]})
            assert (r.status_code, r.json()["values"]) == (200, [340.0, 340.0])
    finally:
        fn.kill()


def test_a_stalled_or_departed_client_is_dropped_after_the_read_timeout_in_one_line(served):
    """--read-timeout 1: a client that sends half a body then stalls, or half its headers, is disconnected after
    about 1 s; one that leaves mid-body is one line on the server's stderr (not a traceback); the server goes on."""
    host, port = served.url.removeprefix("http://").split(":")
    head = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    for sent in (head + b"{" * 100, head[:30]):
        with socket.create_connection((host, int(port)), timeout=10) as client:
            client.sendall(sent)
            start = time.monotonic()
            assert client.recv(1000) == b""  # closed by the server
            assert 0.9 < time.monotonic() - start < 5
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(head + b"{" * 100)
        time.sleep(0.3)  # the server has read the 100 bytes
    with httpx.Client(timeout=60) as http:
        assert http.post(f"{served.url}/score", json={"samples": [RED]}).json()["values"] == [1.0]
    assert _stderr(served.proc, wait_s=1.0).splitlines() == [
        "dropped a request from 127.0.0.1: no byte for 1 s (--read-timeout) after 100 of 1,000 body bytes",
        "dropped a request from 127.0.0.1: the client closed the connection after 100 of 1,000 body bytes",
    ]


def _stderr(proc, wait_s: float) -> str:
    """What the server wrote on stderr until it wrote nothing for ``wait_s``."""
    fd, out = proc.stderr.fileno(), b""
    while select.select([fd], [], [], wait_s)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
    return out.decode()


def test_a_busy_port_or_an_unknown_host_is_one_line_before_the_source_loads(capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["serve-reward-model", "source.verifier=vocab_answer", "--port", str(port)]) == 2
    assert capsys.readouterr().err == (
        f"vlrft serve-reward-model: error: cannot listen on 127.0.0.1:{port}: Address already in use (another "
        "process listens there; --port 0 takes any free port)\n"
    )
    assert main(["serve-reward-model", "source.verifier=vocab_answer", "--host", "no-such-host.invalid"]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"vlrft serve-reward-model: error: --host no-such-host\.invalid: cannot listen there: [^\n]+ \(want an "
        r"address or a name of this machine\)\n",
        err,
    ), err


@pytest.mark.parametrize(
    ("body", "reply"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "the body is JSON nested deeper than this server reads (about 1000 levels)"),
        ({"samples": [{**RED, "answer": ["red"]}]}, "samples[0].answer: want a string or null, got a list"),
        ({"samples": [RED, {**RED, "task": 3}]}, "samples[1].task: want a string or null, got a number"),
        ({"samples": [{**RED, "system": {}}]}, "samples[0].system: want a string or null, got an object"),
        (
            {"samples": [{**RED, "images": ["x.png", 7]}]},
            "samples[0].images[1]: want a data URI or a path (a string), got a number",
        ),
        ({"samples": [{**RED, "metadata": []}]}, "samples[0].metadata: want a dict"),
        ({"samples": [{**RED, "id": 1}]}, "samples[0].id: want a string"),
        (b"\xff\xfe{", "the body is not JSON: 'utf-16-le' codec can't decode byte 0x7b in position 2: truncated data"),
    ],
)
def test_a_malformed_request_is_400_in_one_line_naming_the_field(served, body, reply):
    with httpx.Client(timeout=60) as http:
        if isinstance(body, bytes):
            r = http.post(f"{served.url}/score", content=body, headers={"content-type": "application/json"})
        else:
            r = http.post(f"{served.url}/score", json=body)
    assert (r.status_code, r.text) == (400, reply)


def test_a_body_over_the_size_cap_is_413_in_one_line(served):
    """Refused from its Content-Length, or (chunked: no length) once the bytes read pass the cap."""
    body = json.dumps({"samples": [{**RED, "prompt": "x" * (1 << 20)}]}).encode()
    with httpx.Client(timeout=60) as http:
        for content in (body, iter([body[i : i + 65536] for i in range(0, len(body), 65536)])):
            r = http.post(f"{served.url}/score", content=content, headers={"content-type": "application/json"})
            assert (r.status_code, r.text) == (413, "the body is over --max-request-mib 1 (1,048,576 bytes)")
