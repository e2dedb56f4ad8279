"""The gated policy served live: the router builds it by name, it decides every request, and on a uniform pair of
replicas whose requests share one long prompt it hands decisions to its heuristic (router/policy/gated.py)."""

from __future__ import annotations

from routewise_vllm.router.app import ROUTER

PROMPT = "You are a careful assistant for one tenant. " * 60  # ~2,600 characters: ten 64-token prefix blocks


async def _ask(client, n: int = 12) -> None:
    """`n` completions sharing PROMPT, each answered."""
    for i in range(n):
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT + f"question {i}",
                                                          "max_tokens": 4})
        assert resp.status == 200, await resp.text()


async def test_gated_serves_and_hands_a_shared_prompt_pool_to_its_heuristic(fakes, router_client):
    a, b = await fakes(2)
    client = await router_client([a.url, b.url], policy="gated")
    await _ask(client)
    gate = client.app[ROUTER].main.policy.primary
    # the first request shares no prefix (the cache share starts at 0, learned); the next ones find the prompt's
    # blocks on the replica that served it, the share passes 0.3, and no TPOT floors (the fakes' answers are too
    # short to measure) means no evidence that speeds differ: the heuristic decides
    assert gate.decisions["learned"] >= 1 and gate.decisions["heuristic"] >= 1, gate.describe()
    assert sum(gate.decisions.values()) == 12
    info = client.app[ROUTER].main.policy.describe()["primary"]
    assert info["name"] == "gated" and info["heuristic"]["name"] == "llm-d" and info["version"].startswith("any-fleet")


async def test_gated_model_serves_live_with_that_model_deciding(fakes, router_client):
    """`--policy gated:cache-fleet`: the router builds the gate around the named model, and that model decides the
    learned decisions (no fallback to least-outstanding)."""
    a, b = await fakes(2)
    client = await router_client([a.url, b.url], policy="gated:cache-fleet")
    await _ask(client)
    served = client.app[ROUTER].main.policy
    gate = served.primary
    assert gate.decisions["learned"] >= 1 and sum(gate.decisions.values()) == 12, gate.describe()
    assert served.fallback_share == 0.0
    info = served.describe()["primary"]
    assert info["name"] == "gated" and info["version"].startswith("cache-fleet")
