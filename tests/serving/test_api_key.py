"""--api-key guards every route but the open ones, checked on the app itself (no model loads)."""

from __future__ import annotations

import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from serving.app import OPEN_PATHS, ServeOptions, build_state, create_app

KEY = "test-key"


def _client(**options) -> tuple:
    options = ServeOptions(api_key=KEY, **options)
    app = create_app(build_state(options), options)
    return app, TestClient(app, raise_server_exceptions=False)


def _routes(app) -> list[tuple[str, str]]:
    """Every (method, path) the app serves, /docs and /openapi.json included; a route added later is in it."""
    routes = [(method, r.path) for r in app.routes if isinstance(r, Route) for method in sorted(r.methods or ())]
    assert len(routes) > 15
    return routes


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_every_route_but_health_needs_the_key(key):
    app, client = _client()
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    guarded = [(m, path) for m, path in _routes(app) if path not in OPEN_PATHS]
    for needed in ("/tokenize", "/detokenize", "/tokenizer_info", "/version", "/docs", "/openapi.json", "/metrics"):
        assert needed in {path for _, path in guarded}
    for method, path in guarded:
        r = client.request(method, path, headers=headers, json={})
        assert r.status_code == 401, (method, path, r.status_code, r.text)
        if method != "HEAD":  # a HEAD answer has no body
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/health", headers=headers).status_code == 503  # open: the model is still loading


def test_the_key_lets_requests_through():
    _, client = _client()
    headers = {"Authorization": f"Bearer {KEY}"}
    assert client.get("/version", headers=headers).status_code == 200
    assert client.get("/openapi.json", headers=headers).status_code == 200
    assert client.get("/metrics", headers=headers).status_code == 200


def test_metrics_without_auth_opens_metrics_only():
    _, client = _client(metrics_without_auth=True)
    assert client.get("/metrics").status_code == 200
    assert client.get("/version").status_code == 401
    assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 401
