"""The server's HTTPS option and API-key rotation, live: one `python -m layerline.server` over TLS (a
self-signed certificate made here), driven with the official openai client on an httpx client that trusts
that certificate. Its plan names one stage that nothing serves: these checks never reach the pipeline
(authentication and TLS come first), so no worker is started for them."""
from __future__ import annotations

import datetime
import ipaddress
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from helpers import stop_process

from layerline.local import free_ports, local_keys

KEY1, KEY2, KEY3 = "sk-first-0123456789", "sk-second-0123456789", "sk-third-0123456789"


def self_signed(cert: Path, key: Path) -> None:
    """A certificate for 127.0.0.1 and localhost, signed by its own key (written 0600)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    k = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "layerline test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    c = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(k.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                     x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
         .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
         .sign(k, hashes.SHA256()))
    cert.write_bytes(c.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    key.chmod(0o600)


def write_keys(path: Path, *keys: str, replace: bool = True) -> None:
    """The keys file as a user or the role rewrites it: a new file renamed over the old one, or in place."""
    text = "".join(k + "\n" for k in keys)
    if replace:
        tmp = path.with_suffix(".new")
        tmp.write_text(text)
        tmp.chmod(0o600)
        os.replace(tmp, path)
    else:
        with open(path, "w") as f:
            f.write(text)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    self_signed(cert, key)
    api, admin = tmp / "api_keys", tmp / "admin_key"
    write_keys(api, KEY1)
    write_keys(admin, "admin-0123456789")
    keys = local_keys(str(tmp), ["stage0"])
    port, nobody = free_ports(2)
    plan = {"precision": "fp32", "objective": "throughput", "num_layers": 1, "predicted_token_s": 0.0,
            "bottleneck_s": 0.0, "kv": {"context": 64, "dtype": "fp32", "bytes_per_token": 0},
            "stages": [{"host": "stage0", "role": "active", "layers": [0, 1], "endpoint": f"tcp://127.0.0.1:{nobody}",
                        "device": "cpu", "precision": "fp32", "weight_bytes": 0, "kv_bytes": 0,
                        "kv_dtype": "fp32", "mem_budget_bytes": 0, "predicted_s": 0.0}]}
    (tmp / "plan.json").write_text(json.dumps(plan))
    ready, log = tmp / "ready.json", tmp / "requests.log"
    err = open(tmp / "server.err", "w")
    proc = subprocess.Popen([sys.executable, "-m", "layerline.server", "--plan", str(tmp / "plan.json"),
                             "--keys", os.path.join(keys, "controller"), "--port", str(port),
                             "--api-keys", str(api), "--admin-keys", str(admin), "--tls-cert", str(cert),
                             "--tls-key", str(key), "--ready-file", str(ready), "--log-file", str(log),
                             "--restart-wait", "600"],
                            stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not ready.exists():
            assert proc.poll() is None, f"server exited {proc.returncode}: {(tmp / 'server.err').read_text()[-2000:]}"
            assert time.time() < deadline, "the server wrote no ready file in 120 s"
            time.sleep(0.1)
        yield {"proc": proc, "url": json.loads(ready.read_text())["url"], "cert": cert, "api": api, "log": log}
    finally:
        stop_process(proc)
        err.close()


def trusting(srv) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(srv["cert"]))


def client(srv, key: str) -> openai.OpenAI:
    """The official client on an httpx client that trusts the test's certificate (closed after each use, so
    the server's shutdown waits for no idle connection)."""
    return openai.OpenAI(base_url=srv["url"] + "/v1", api_key=key, max_retries=0, timeout=30,
                         http_client=httpx.Client(verify=trusting(srv)))


def works(srv, key: str) -> bool:
    with client(srv, key) as c:
        try:
            c.models.list()
            return True
        except openai.AuthenticationError:
            return False


def test_https_with_a_certificate_from_the_inventory(tls_server):
    assert tls_server["url"].startswith("https://127.0.0.1:")
    with client(tls_server, KEY1) as c:
        assert [m.id for m in c.models.list().data]
    # a client that does not trust the certificate gets no answer: this is TLS, not plain HTTP
    with pytest.raises(openai.APIConnectionError):
        openai.OpenAI(base_url=tls_server["url"] + "/v1", api_key=KEY1, max_retries=0, timeout=10).models.list()
    with pytest.raises(httpx.HTTPError):
        httpx.get(tls_server["url"].replace("https://", "http://") + "/v1/models", timeout=10)


def test_admin_routes_over_tls_still_need_their_key(tls_server):
    r = httpx.post(tls_server["url"] + "/admin/route", json={"plan": {}}, verify=trusting(tls_server),
                   headers={"Authorization": f"Bearer {KEY1}"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key"


def test_api_keys_rotate_without_a_restart(tls_server):
    api, pid = tls_server["api"], tls_server["proc"].pid
    assert works(tls_server, KEY1) and not works(tls_server, KEY2)
    write_keys(api, KEY2)                       # renamed over the old file (what the role and editors do)
    assert works(tls_server, KEY2) and not works(tls_server, KEY1)
    write_keys(api, KEY2, KEY3, replace=False)  # rewritten in place
    assert works(tls_server, KEY3) and works(tls_server, KEY2)
    api.chmod(0o644)                            # a file others may read is not taken: the keys before stay
    os.utime(api)
    assert works(tls_server, KEY3)
    api.chmod(0o600)
    tls_server["proc"].send_signal(signal.SIGHUP)   # re-reads the file; does not stop the server
    write_keys(api, KEY1, replace=False)
    assert works(tls_server, KEY1) and not works(tls_server, KEY3)
    assert tls_server["proc"].poll() is None and tls_server["proc"].pid == pid
    assert "chmod 600" in tls_server["log"].read_text()
