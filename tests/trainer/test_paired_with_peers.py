"""ppo.paired_with_peers: the peers' algorithms join the heuristics a run pairs its rewards with and selects against."""

from __future__ import annotations

from pathlib import Path

from routewise_vllm.router.policy.registry import BASELINES, COMPARED_BASELINES, PEER_BASELINES
from routewise_vllm.trainer.config import load_config
from routewise_vllm.trainer.episode import HeuristicRun
from routewise_vllm.trainer.ppo import compared_heuristics, select_best_heuristics

ROOT = Path(__file__).resolve().parents[2]


class FakePool:
    """Runs no episode: each heuristic's p99 TTFT is its value in `p99` (9 s for the others)."""

    def __init__(self, p99: dict[str, float]) -> None:
        self.p99 = p99
        self.asked: list[str] = []

    def split(self, jobs, key):
        return [jobs]

    def run(self, kind, parts):
        assert kind == "heuristics"
        jobs = [j for part in parts for j in part["jobs"]]
        self.asked = sorted({j.policy for j in jobs})
        return [HeuristicRun(j.spec, j.policy, {"ttft_p99_s": self.p99.get(j.policy, 9.0)}) for j in jobs]


def test_off_by_default_and_the_peers_join_when_asked():
    plain = load_config(ROOT / "trainer/configs/smoke.yaml")
    assert plain.ppo.paired_with_peers is False
    assert compared_heuristics(plain) == COMPARED_BASELINES
    with_peers = load_config(ROOT / "trainer/configs/smoke.yaml", ["ppo.paired_with_peers=true"])
    names = compared_heuristics(with_peers)
    assert names[:len(COMPARED_BASELINES)] == COMPARED_BASELINES
    assert set(names) - set(COMPARED_BASELINES) == set(PEER_BASELINES) == {"llm-d", "llm-d-blend", "dynamo-kv"}
    assert all(n in BASELINES for n in names)


def test_a_peer_is_chosen_as_the_paired_heuristic_only_with_the_option():
    p99 = {"dynamo-kv": 0.1, "expected-wait": 0.5}
    for overrides, best in (([], "expected-wait"), (["ppo.paired_with_peers=true"], "dynamo-kv")):
        cfg = load_config(ROOT / "trainer/configs/smoke.yaml", overrides)
        pool = FakePool(p99)
        chosen, table, _ = select_best_heuristics(pool, cfg)
        assert set(chosen.values()) == {best}
        assert ("dynamo-kv" in pool.asked) == bool(overrides)
        assert set(table[cfg.env.scenarios[0]]) == set(compared_heuristics(cfg))
