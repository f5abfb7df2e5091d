"""Routing over several servers (`kvbench replay --routing`, replay/routing.py): where each request
goes, and that a plan never names a source cache its server does not hold."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.contracts import Plan
from kvbench.replay.routing import Router
from kvbench.replay.stub import StubServer
from kvbench.tracegen.generate import TraceSpec, generate_trace
from kvbench.tracegen.tokenizer import load_tokenizer

URLS = ["http://a", "http://b"]


@pytest.fixture(scope="module")
def trajectory(tiny_tokenizer_dir: Path):
    _, (first, *_) = generate_trace(TraceSpec(num_agents=4, shared_tokens=64, output_len=4, num_trajectories=1),
                                    load_tokenizer(str(tiny_tokenizer_dir)))
    return first


def _placed(router: Router, index: int, trajectory) -> dict[str, str]:
    placed: dict[str, str] = {}
    for turn in trajectory.turns:
        placed[turn.turn_id] = router.route(index, trajectory, turn, placed)
    return placed


def test_each_policy_places_the_turns_as_documented(trajectory) -> None:
    assert set(_placed(Router(URLS, "trajectory"), 1, trajectory).values()) == {"http://b"}
    agent = _placed(Router(URLS, "agent"), 1, trajectory)
    assert [agent[t.turn_id] for t in trajectory.turns] == ["http://b", "http://a", "http://b", "http://a"]
    assert list(_placed(Router(URLS, "round-robin"), 0, trajectory).values()) == URLS * 2
    # cache-aware: the first turn to the least loaded server, every reader to its sources' server
    router = Router(URLS, "cache-aware", in_flight={"http://a": 3})
    assert set(_placed(router, 0, trajectory).values()) == {"http://b"}
    with pytest.raises(ValueError, match="unknown routing 'random'"):
        Router(URLS, "random")


@pytest.mark.parametrize("routing, crossing", [("agent", True), ("cache-aware", False), ("trajectory", False)])
def test_a_plan_names_only_sources_on_its_own_server(routing: str, crossing: bool, tiny_tokenizer_dir: Path,
                                                      tmp_path: Path) -> None:
    with StubServer(connector=True) as one, StubServer(connector=True) as two:
        result = CliRunner().invoke(main, [
            "replay", "--model", str(tiny_tokenizer_dir), "--method", "fullshared", "--qps", "0",
            "--num-trajectories", "2", "--shared-tokens", "64", "--output-len", "4", "--routing", routing,
            "--base-url", one.base_url, "--base-url", two.base_url, "--result-dir", str(tmp_path / "run")],
            prog_name="kvbench")
        assert result.exit_code == 0, result.output
        served = {rid: url for stub in (one, two) for rid in stub.bodies for url in [stub.base_url]}
        bodies = {**one.bodies, **two.bodies}
    requests = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    assert requests["success"].all() and (requests["server_url"] == requests["request_id"].map(served)).all()
    by_turn = {(r.trajectory_id, r.turn_id): r.server_url for r in requests.itertuples()}
    named = 0
    for row in requests.itertuples():
        plan = Plan.from_params(bodies[row.request_id]["kv_transfer_params"])
        assert plan is not None
        for segment in plan.segments:
            if segment.source_turn is not None:
                named += 1
                assert by_turn[(row.trajectory_id, segment.source_turn)] == row.server_url
    crossed = sum(1 for r in requests.itertuples() if isinstance(r.edge_source, str) and
                  by_turn[(r.trajectory_id, r.edge_source.split(",")[0])] != r.server_url)
    assert (crossed == len(requests) - 2) if crossing else (crossed == 0 and named > 0)  # agent: every edge crosses
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["routing"] == routing


def test_a_run_resumes_only_with_its_routing(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    args = ["replay", "--model", str(tiny_tokenizer_dir), "--qps", "0", "--num-trajectories", "1", "--shared-tokens",
            "64", "--output-len", "4", "--result-dir", str(tmp_path / "run")]
    with StubServer() as one, StubServer() as two:
        servers = ["--base-url", one.base_url, "--base-url", two.base_url]
        assert CliRunner().invoke(main, [*args, *servers, "--routing", "agent"]).exit_code == 0
        refused = CliRunner().invoke(main, [*args, *servers, "--resume"])
    assert refused.exit_code == 1 and "routed with --routing agent" in refused.output


def test_servers_sharing_a_tier_read_finished_sources_across_servers(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    """With one Mooncake master behind both servers, agent routing names the sources on the other
    server (read there from the shared tier); config.json records that the servers share one."""
    tier = {"master": "127.0.0.1:1", "metadata": "http://127.0.0.1:2/metadata"}
    with StubServer(connector=True, shared_tier=tier) as one, StubServer(connector=True, shared_tier=tier) as two:
        result = CliRunner().invoke(main, [
            "replay", "--model", str(tiny_tokenizer_dir), "--method", "fullshared", "--qps", "0",
            "--num-trajectories", "2", "--shared-tokens", "64", "--output-len", "4", "--routing", "agent",
            "--base-url", one.base_url, "--base-url", two.base_url, "--result-dir", str(tmp_path / "run")],
            prog_name="kvbench")
        assert result.exit_code == 0, result.output
        bodies = {**one.bodies, **two.bodies}
    requests = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    by_turn = {(r.trajectory_id, r.turn_id): r.server_url for r in requests.itertuples()}
    crossing = 0
    for row in requests.itertuples():
        plan = Plan.from_params(bodies[row.request_id]["kv_transfer_params"])
        sources = [s for s in plan.segments if s.source_turn is not None]
        crossing += any(by_turn[(row.trajectory_id, s.source_turn)] != row.server_url for s in sources)
    assert crossing == len(requests) - 2  # every reader names a source on the other server (agent routing)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["shared_tier_readable"] is True


def test_agent_routing_follows_the_agent_not_the_turn(tiny_tokenizer_dir: Path) -> None:
    """Two agents over three rounds on three servers: a turn's index differs from its agent's
    place among the agents even modulo the servers, so routing by turn would put an agent's turns
    on several servers; `agent` routing keeps each on one, (trajectory + agent) mod N."""
    _, (first, *_) = generate_trace(TraceSpec(num_agents=2, rounds=3, shared_tokens=64, output_len=4,
                                              num_trajectories=1), load_tokenizer(str(tiny_tokenizer_dir)))
    urls = ["http://a", "http://b", "http://c"]
    placed = _placed(Router(urls, "agent"), 2, first)
    agents = list(first.agents)
    assert len(first.turns) == 6 and any(i % 3 != agents.index(t.agent) for i, t in enumerate(first.turns))
    for turn in first.turns:
        assert placed[turn.turn_id] == urls[(2 + agents.index(turn.agent)) % 3], turn.turn_id
