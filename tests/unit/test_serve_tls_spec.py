"""The server's HTTPS option, from the inventory to its launch spec (layerline.spec.server_spec)."""
import pytest

from layerline.settings import SettingsError
from layerline.spec import server_spec

BASE = {"layerline_checkpoint": "/ck/model", "layerline_home": "/h"}


def test_tls_from_the_inventory_reaches_argv_url_and_curl():
    s = server_spec(BASE | {"layerline_serve_tls_cert": "/etc/ll/cert.pem", "layerline_serve_tls_key": "/etc/ll/k.pem"})
    argv = list(s.argv)
    assert argv[argv.index("--tls-cert") + 1] == "/etc/ll/cert.pem" and argv[argv.index("--tls-key") + 1] == "/etc/ll/k.pem"
    assert s.url.startswith("https://127.0.0.1:") and s.ca_path == "/etc/ll/cert.pem"
    assert "--cacert /etc/ll/cert.pem" in s.curl and "https://" in s.curl
    s = server_spec(BASE | {"layerline_serve_tls_cert": "/c", "layerline_serve_tls_key": "/k",
                            "layerline_serve_tls_ca": "/ca.pem"})
    assert s.ca_path == "/ca.pem"
    plain = server_spec(BASE)
    assert "--tls-cert" not in plain.argv and plain.url.startswith("http://") and plain.ca_path is None


def test_a_certificate_without_its_key_is_one_line_naming_both():
    with pytest.raises(SettingsError, match="layerline_serve_tls_cert and layerline_serve_tls_key"):
        server_spec(BASE | {"layerline_serve_tls_cert": "/c"})
