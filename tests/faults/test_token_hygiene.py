"""Tokens never reach the logs (issue 13): a real `hai server` is driven through every kind of
authenticated request -- users, a node agent, tokens created and revoked, a token tried in the
query string, wrong tokens -- and its whole log output is searched for every secret issued."""

from __future__ import annotations

from hai.protocol import AgentHello, GpuInfo


def test_no_issued_token_appears_in_the_server_logs(live_server, topology):
    live_server.start(topology=topology)
    issued = [live_server.admin_token, live_server.agent_token]
    with live_server.client() as admin:
        assert admin.get("/api/v1/me").status_code == 200
        for name in ("ci", "laptop"):
            r = admin.post("/api/v1/tokens", json={"name": name, "expires_in_s": 3600})
            assert r.status_code == 201, r.text
            issued.append(r.json()["token"])
            token_id = r.json()["id"]
        with live_server.client(issued[-1]) as user:
            assert user.get("/api/v1/jobs").status_code == 200
            r = user.post("/api/v1/jobs", json={"name": "j", "command": ["true"], "gpus_per_node": 1},
                          headers={"Idempotency-Key": "log-test"})
            assert r.status_code == 201, r.text
        assert admin.delete(f"/api/v1/tokens/{token_id}").status_code == 200
        with live_server.client(issued[-1]) as revoked:
            assert revoked.get("/api/v1/me").status_code == 401
        # a token in the URL is refused, and its access-log line is masked
        assert admin.get("/api/v1/me", params={"access_token": issued[2]}).status_code == 400
        assert admin.get("/api/v1/jobs", params={"q": issued[2]}).status_code in (200, 422)
    with live_server.client(live_server.agent_token) as agent:
        hello = AgentHello(node="n0", zone="A", leaf="A1", address="127.0.0.1", fake_gpus=True,
                           gpus=[GpuInfo(index=0, uuid="GPU-n0-0", model="Fake", memory_total_mib=1024)])
        assert agent.post("/api/v1/agent/register", json=hello.model_dump(mode="json")).status_code == 200
    with live_server.client("hai_" + "x" * 43) as wrong:
        assert wrong.get("/api/v1/me").status_code == 401
    live_server.kill()

    logs = live_server.logs()
    assert "GET /api/v1/me" in logs and "POST /api/v1/agent/register" in logs  # the access log is there
    assert "access_token=hai_***" in logs  # the refused URL was logged, masked
    leaked = [t[:10] for t in issued if t in logs]
    assert leaked == [], f"tokens found in the server log: {leaked}"
    assert "x" * 43 not in logs
