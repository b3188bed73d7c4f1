"""schemathesis against the live server's OpenAPI schema: no generated request gets a 5xx.

For each operation the schema describes, hypothesis draws requests from schemathesis' strategy
(valid and, in negative mode, invalid requests alike), capped in size (n, max_tokens) so each costs at most a few
decoded tokens; everything else reaches the server as drawn. (schemathesis' own pytest plugin is
not used: the hypothesis strategy is the part this test needs.)
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

OPERATIONS = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
              ("POST", "/v1/completions"), ("GET", "/version"), ("POST", "/tokenize"), ("POST", "/detokenize"),
              ("GET", "/tokenizer_info"), ("POST", "/v1/responses"), ("POST", "/v1/load_lora_adapter"),
              ("POST", "/v1/unload_lora_adapter"), ("POST", "/pooling"), ("POST", "/classify")]
_CAPS = {"n": 2, "max_tokens": 3, "max_completion_tokens": 3, "best_of": 2}


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.base_url}/openapi.json", headers=server.headers())


def _cap(body):
    if isinstance(body, dict):
        for key, cap in _CAPS.items():
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > cap:
                body[key] = cap
        body.setdefault("max_tokens", 3)
    return body


def test_schema_lists_every_route(api_schema):
    found = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert found == set(OPERATIONS)


@pytest.mark.slow
@pytest.mark.parametrize("method, path", OPERATIONS)
def test_no_server_errors(api_schema, server, method, path):
    operation = api_schema[path][method]

    cases = st.one_of(operation.as_strategy(), operation.as_strategy(schemathesis.GenerationMode.NEGATIVE))

    @given(case=cases)
    @settings(max_examples=40 if method == "POST" else 5, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case):
        case.body = _cap(case.body)
        response = case.call(base_url=server.base_url, headers=server.headers(), timeout=120)
        assert response.status_code < 500, (case.body, response.status_code, response.text[:500])

    check()
