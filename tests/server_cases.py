"""The server tests' set-up: a server built as the CLI builds it (random weights or the
trained model, any cache), the official ``openai`` client on it, raw HTTP for what no client
sends, and the wait until the engine holds nothing (its invariants checked on its thread)."""

import socket
import time
import urllib.error
import urllib.request

import openai

from vmcache.sequences.invariants import check_invariants
from vmcache.server.cli import Running, build_server, parse_args

MODEL = "smollm2-135m-instruct"
# (the eager step: the compiled one, the server's default, has its own tests in
# tests/engine/test_engine_compiled.py and tests/project/test_docs_commands.py)
BASE = ["--max-seqs", "8", "--max-seq-len", "1024", "--pool-mib", "64", "--max-waiting", "16",
        "--no-compile"]  # fmt: skip


def start(real, *extra) -> Running:
    model, tok = real
    server, _ = build_server(parse_args([*BASE, *extra]), model, tok)
    return Running(server)


def client(running, key="none") -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url, api_key=key, max_retries=0, timeout=120)


def chat(c, question, **kw):
    return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                     temperature=0, **kw)  # fmt: skip


def streamed(c, question, **kw) -> tuple[dict, dict, object]:
    """(text per index, finish reason per index, the usage chunk) of a streamed chat."""
    texts, reasons, usage = {}, {}, None
    for ch in chat(c, question, stream=True, **kw):
        if not ch.choices:
            usage = ch.usage
        for choice in ch.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    return texts, reasons, usage


def settled(running, timeout_s=30.0):
    """Wait until the engine holds no sequence; then (pages in use, pages the prefix index
    holds), the cache's invariants checked on its thread."""

    def look(engine):
        kv = engine.kv
        check_invariants(kv)
        return len(kv.sequences), kv._pool.num_used, kv.prefix.index.stats().cached_pages

    deadline = time.monotonic() + timeout_s
    while True:
        live, used, cached = running.server.loop.query(look)
        if live == 0 or time.monotonic() > deadline:
            return live, used, cached
        time.sleep(0.05)


def http(method, url, body: bytes | None = None) -> tuple[int, str]:
    """(status, body text) of a raw request: what no client library would send."""
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def oversized(running, chunked: bool) -> tuple[int, str]:
    """(status, body text) of a POST whose body passes the 1 MiB cap: declared by its
    Content-Length (nothing sent after the head), or sent chunked without one. A raw socket,
    since a server that refuses early may close before a client library has sent it all."""
    size = (1 << 20) + 1
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\n{'Transfer-Encoding: chunked' if chunked else f'Content-Length: {size}'}"
            "\r\nConnection: close\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", running.port), timeout=60) as s:
        s.sendall(head + (f"{size:x}\r\n".encode() + b"x" * size + b"\r\n" if chunked else b""))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():  # the reply's own chunks
        body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    return int(head.split()[1]), body.decode()


def root(running) -> str:
    return running.url.removesuffix("/v1")


def unlabelled(text: str, model: str = MODEL) -> dict[str, float]:
    """The samples of a ``/metrics`` page of ``model`` (its ``model_name`` label taken out;
    other models' samples left out)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        label = f'model_name="{model}"'
        if "model_name=" in key and label not in key:
            continue
        key = key.replace("{" + label + "}", "").replace(label + ",", "").replace("," + label, "")
        out[key] = float(value)
    return out
