"""The command line and the clients on bad input and bad credentials: a clear message and a
quick exit, never a traceback, a wait for the whole timeout, or retries forever."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollq import Consumer, EchoEngine, Producer
from rollq.connection import connect
from rollq.errors import RedisAuthError
from rollq.server import RedisServer
from tests.test_cli import rollq


@pytest.mark.parametrize("content, says", [
    (b"", "no jobs"),
    (b"\n\n", "no jobs"),
    (b'{"prompt": "x", "meta": ' + b"[" * 5000 + b"]" * 5000 + b"}\n", "nested too deep"),
    (b'{"prompt": "x", "meta": ' + b"[" * 100 + b"]" * 100 + b"}\n", "meta nests deeper"),
    (b'{"prompt": "\xff\xfe"}\n', "not UTF-8"),
], ids=["empty", "blank-lines", "deep-json", "deep-meta", "bad-utf8"])
def test_submit_refuses_bad_files_at_once(tmp_path, redis_url, queue, content, says):
    f = tmp_path / "jobs.jsonl"
    f.write_bytes(content)
    t0 = time.monotonic()
    r = rollq("submit", "--url", redis_url, "--queue", queue, str(f), "--wait", "--timeout", "60")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert says in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 30  # not the --wait timeout


def test_unreachable_redis_and_unreadable_url_file_are_one_line(tmp_path):
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"prompt": "x"}\n')
    r = rollq("submit", "--url", "redis://127.0.0.1:1/0", str(ok))
    assert r.returncode == 3 and "cannot reach Redis" in r.stderr and "Traceback" not in r.stderr
    r = rollq("status", "--url-file", str(tmp_path / "missing"))
    assert r.returncode == 2 and "cannot read the Redis URL file" in r.stderr


@pytest.fixture
def password_redis():
    srv = RedisServer(extra_args=["--requirepass", "s3cret"]).start()
    yield srv
    srv.cleanup()


async def test_wrong_password_fails_fast_everywhere(password_redis, queue, tmp_path):
    """A wrong password made consumers retry forever (redis-py reports it as a kind of
    ConnectionError, which every retry loop took for an outage)."""
    port = password_redis.port
    wrong, right = f"redis://:nope@127.0.0.1:{port}/0", f"redis://:s3cret@127.0.0.1:{port}/0"
    with pytest.raises(RedisAuthError, match="refused user 'default'"):
        await connect(wrong).ping()
    c = Consumer(EchoEngine(), wrong, queue)
    with pytest.raises(RedisAuthError):
        await asyncio.wait_for(c.run(), 20)
    with pytest.raises(RedisAuthError):
        async with Producer(wrong, queue):
            pass
    good = connect(right)
    assert await good.ping()
    await good.aclose()
    # The CLI says so in one line and exits non-zero; the URL may come from a file (no
    # password in ps) or from the environment.
    url_file = tmp_path / "url"
    url_file.write_text(wrong + "\n")
    r = rollq("consume", "--url-file", str(url_file), "--queue", queue, "--engine", "echo", "--burst")
    assert r.returncode == 2 and "refused user" in r.stderr and "Traceback" not in r.stderr
    url_file.write_text(right + "\n")
    r = rollq("status", "--queue", queue, "--json", env={"ROLLQ_REDIS_URL_FILE": str(url_file)})
    assert r.returncode == 0, r.stderr


def test_cli_log_lines_are_cut_and_not_highlighted():
    import logging

    from rollq.cli.common import MAX_LOG_CHARS, CutLongMessages

    rec = logging.LogRecord("rollq", logging.WARNING, __file__, 1, "dead-lettered job %s", ("x" * 40_000,), None)
    assert CutLongMessages().filter(rec)
    assert len(rec.getMessage()) < MAX_LOG_CHARS + 40 and rec.getMessage().endswith("(40018 characters)")


@pytest.fixture
def tls_redis(tmp_path):
    """A redis-server with a TLS port whose certificate a CA of the test's own signed (no
    client trusts it by default); the plain port stays for the fixture's readiness check."""
    import shutil
    import subprocess

    if not shutil.which("openssl"):
        pytest.skip("needs openssl to make a certificate")
    ca_key, ca, key, csr, cert = (str(tmp_path / n) for n in ("ca.key", "ca.crt", "srv.key", "srv.csr", "srv.crt"))
    ext = tmp_path / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=rollq-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert, "-days", "2",
        "-extfile", str(ext))
    from rollq.server import free_port

    tls_port = free_port()
    srv = RedisServer(extra_args=["--tls-port", str(tls_port), "--tls-cert-file", cert, "--tls-key-file", key,
                                  "--tls-ca-cert-file", ca, "--tls-auth-clients", "no"])
    try:
        srv.start()
    except Exception as e:  # a redis-server built without TLS
        pytest.skip(f"redis-server cannot serve TLS here: {e}")
    yield f"rediss://127.0.0.1:{tls_port}/0", ca
    srv.cleanup()


async def test_a_certificate_that_fails_the_check_fails_fast_as_a_wrong_password(tls_redis, queue):
    """A TLS consumer whose certificate check failed retried as if Redis were down (it raises
    RedisTLSError, a RedisAuthError)."""
    url, ca = tls_redis
    good = connect(url, ssl_ca_certs=ca)  # the server is fine: trusting its CA, the check passes
    assert await good.ping()
    await good.aclose()
    with pytest.raises(RedisAuthError, match="TLS certificate check failed"):
        await connect(url).ping()
    c = Consumer(EchoEngine(), url, queue)
    with pytest.raises(RedisAuthError, match="TLS certificate check failed"):
        await asyncio.wait_for(c.run(), 20)  # retried until the wait ran out
    with pytest.raises(RedisAuthError, match="TLS certificate check failed"):
        async with Producer(url, queue):
            pass
    r = rollq("consume", "--url", url, "--queue", queue, "--engine", "echo", "--burst")
    assert r.returncode == 2 and "certificate" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_consume_passes_engine_args_to_vllm_and_refuses_its_own_options_there():
    """``rollq consume --engine-arg KEY=VALUE`` reaches vLLM's AsyncEngineArgs (values read as
    JSON); a field the installed vLLM lacks is refused by name, and a field rollq sets from
    its own options, or a malformed pair, stops the command line at once."""
    pytest.importorskip("vllm")
    from rollq.cli.consume import make_engine
    from rollq.cli.main import build_parser
    from rollq.consumer._vllm_api import _vllm, engine_args

    a = build_parser().parse_args(["consume", "--engine", "vllm", "--model", "m", "--engine-arg", "load-format=dummy",
                                   "--engine-arg", "max_num_seqs=512", "--engine-arg", "enable_prefix_caching=false"])
    cfg = make_engine(a).config
    assert cfg.engine_kwargs == {"load_format": "dummy", "max_num_seqs": 512, "enable_prefix_caching": False}
    args = engine_args(_vllm(), cfg)
    assert (args.load_format, args.max_num_seqs, args.enable_prefix_caching) == ("dummy", 512, False)
    a = build_parser().parse_args(["consume", "--engine", "vllm", "--model", "m", "--engine-arg", "no_such_field=1"])
    with pytest.raises(ValueError, match=r"has no field\(s\) \['no_such_field'\]"):
        engine_args(_vllm(), make_engine(a).config)
    for bad, says in [("dtype=float16", "dtype is set by --dtype"), ("noequals", "KEY=VALUE"),
                      ("logprobs_mode=processed_logprobs", "labelled")]:
        r = rollq("consume", "--engine", "vllm", "--engine-arg", bad)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (bad, r.stderr)


def test_consume_weight_sync_options_reach_the_follower_settings():
    """``rollq consume``'s weight-sync flags become the replica's WeightSyncSettings."""
    from rollq.cli.consume import weight_settings
    from rollq.cli.main import build_parser

    a = build_parser().parse_args(["consume", "--weights-root", "/w", "--broadcast", "--swap-overlap", "--ipc-prestage",
                                      "--ipc-high-priority", "--ipc-direct"])
    ws = weight_settings(a)
    got = (ws.root, ws.broadcast, ws.swap_overlap, ws.ipc_prestage, ws.ipc_high_priority, ws.ipc_direct)
    assert got == ("/w", True, True, True, True, True)
    ws = weight_settings(build_parser().parse_args(["consume"]))
    got = (ws.root, ws.broadcast, ws.swap_overlap, ws.ipc_prestage, ws.ipc_high_priority, ws.ipc_direct)
    assert got == (None, False, False, False, False, False)
