"""The plugin reads claims from resource.k8s.io/v1 through the official client."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from gpushare.draplugin.server import api_claims
from kubernetes import client
from support.draclaims import REF, claim

from gpushare.contract.resourceclaim import ClaimRef
from gpushare.kube.errors import KubeNotFound

CLAIM_PATH = f"/apis/resource.k8s.io/v1/namespaces/{REF.namespace}/resourceclaims/{REF.name}"


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        found = self.path == CLAIM_PATH
        body = json.dumps(claim() if found else {"kind": "Status", "code": 404}).encode()
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def api() -> Iterator[client.ApiClient]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    with client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{server.server_port}")) as api:
        yield api
    server.shutdown()
    server.server_close()
    thread.join()


def test_the_claim_kubelet_names_is_read_from_resource_k8s_io_v1(api: client.ApiClient) -> None:
    assert api_claims(api)(REF) == claim()


def test_a_missing_claim_is_not_found_naming_it(api: client.ApiClient) -> None:
    with pytest.raises(KubeNotFound, match="ResourceClaim ns/other: not found"):
        api_claims(api)(ClaimRef(namespace="ns", name="other", uid="x"))
