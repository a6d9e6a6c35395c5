"""Who may reach the server's admin routes (layerline.server.auth.admin_reachable)."""
from layerline.server.auth import admin_reachable


def test_admin_routes_answer_from_this_machine_or_over_tls():
    assert admin_reachable("127.0.0.1", "127.0.0.1", False) is None
    assert admin_reachable("::1", "::1", False) is None
    assert admin_reachable("10.77.0.2", "10.77.0.2", False) is None        # this machine, by its own address
    assert admin_reachable("10.77.0.3", "10.77.0.3", True) is None         # TLS: the key decides
    assert admin_reachable("10.77.0.9", "0.0.0.0", True) is None
    why = admin_reachable("10.77.0.9", "10.77.0.2", False)                 # another machine, plain HTTP
    assert why and "layerline_serve_tls_cert" in why
