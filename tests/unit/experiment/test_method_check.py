"""`kvbench check`'s verdicts without a server: the comparisons that decide pass or fail, the
invariants' settings, the switches they set on the delta methods, and the command's refusals.
The invariants on a real vLLM server: tests/engine/test_method_check_vllm.py."""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner

from kvbench.cli import main
from kvbench.experiment.invariants import (
    INVARIANTS,
    ModelFacts,
    first_divergence,
    invariants_of,
    rope_ulps,
    rows_difference,
    worst_layer_excess,
)
from kvbench.methods.registry import validate_params


def test_equal_decodes_have_no_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3], [{}, {}, {}], 0.02) is None


def test_a_clear_winner_lost_is_a_failure_and_a_near_tie_is_not() -> None:
    top = [{1: -0.1}, {2: -0.5, 7: -0.51}, {3: -0.1}]
    tie = first_divergence([1, 7, 9], [1, 2, 3], top, tolerance=0.02)
    assert tie is not None and tie.step == 1 and tie.near_tie and tie.margin == pytest.approx(0.01)
    clear = first_divergence([1, 7, 9], [1, 2, 3], [{1: -0.1}, {2: -0.1, 7: -3.0}, {}], tolerance=0.02)
    assert clear is not None and not clear.near_tie and clear.margin == pytest.approx(2.9)
    # a margin of exactly the tolerance is still a tie (binary-exact values)
    edge = first_divergence([7], [2], [{2: -0.5, 7: -0.75}], tolerance=0.25)
    assert edge is not None and edge.margin == 0.25 and edge.near_tie
    # a token outside the reference's top candidates is never a tie
    unseen = first_divergence([5], [1], [{1: -0.1}], tolerance=10.0)
    assert unseen is not None and unseen.margin == math.inf and not unseen.near_tie


def _layers(*values: float) -> list[dict[str, float]]:
    return [{"k_rel": v, "v_rel": v / 2} for v in values]


def test_kv_within_twice_the_own_forward_noise_passes_and_beyond_it_fails() -> None:
    noise = _layers(0.001, 0.002)
    ratio, where = worst_layer_excess(_layers(0.001, 0.003), noise)
    assert ratio == pytest.approx(0.75) and where.startswith("layer 1 k")
    ratio, where = worst_layer_excess(_layers(0.0, 0.02), noise)
    assert ratio == pytest.approx(5.0) and "allowed 0.004" in where
    # an exact own forward (noise 0) still allows rounding at the floor, not nothing
    assert worst_layer_excess(_layers(5e-5), _layers(0.0))[0] == pytest.approx(0.5)


def test_rows_difference_and_shape_mismatch() -> None:
    assert rows_difference([[1.0, -2.0]], [[1.0, -2.5]]) == (0.5, 2.5)
    assert rows_difference([[1.0]], [[1.0, 2.0]])[0] == math.inf


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_rope_ulps_count_rounding_steps_of_the_cache_dtype(dtype: str) -> None:
    torch.manual_seed(0)
    keys = torch.randn(16, 2, 8).to(getattr(torch, dtype))
    exact = keys.double().tolist()
    assert rope_ulps(exact, exact, dtype) == 0
    # one step of the dtype at each pair's magnitude: at most 1 (up to the pair's power of two)
    step = torch.finfo(getattr(torch, dtype)).eps
    nudged = (keys.double() * (1 + step / 2)).tolist()
    assert 0 < rope_ulps(nudged, exact, dtype) <= 1.0
    # keys rotated by a position off: far beyond it
    assert rope_ulps(torch.roll(keys.double(), 1, dims=0).tolist(), exact, dtype) > 50


def test_every_invariant_sets_parameters_its_method_accepts() -> None:
    facts = ModelFacts(num_layers=6, dtype="bfloat16")
    for invariant in INVARIANTS:
        params = validate_params(invariant.method, invariant.params(facts))
        for name, value in invariant.params(facts).items():
            assert params[name] == value, invariant


def test_invariants_of_names_the_methods_it_checks() -> None:
    assert [i.name for i in invariants_of(["kvcmas"])] == ["gate-dense", "zero-deltas"]
    with pytest.raises(ValueError, match="no invariant for nonshared; methods it checks: cacheblend"):
        invariants_of(["nonshared", "graphflow"])
    from kvbench.methods.registry import all_methods

    # every method but the exact one has a setting where it must equal a known computation
    assert {i.method for i in INVARIANTS} == set(all_methods()) - {"nonshared"}


@pytest.mark.parametrize(("args", "message"), [
    (["check", "--methods", "graphflow", "--base-url", "http://127.0.0.1:1"], "cannot read which method http://127.0.0.1:1 runs"),
    (["check", "--methods", "nonshared"], "kvbench check has no invariant for nonshared"),
    (["check", "--method-param", "tau=0.5"], "kvbench check sets each method's parameters itself"),
    (["check", "--num-trajectories", "2"], "2 is not in the range x>=3"),
])
def test_bad_check_input_is_one_clear_line(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and message in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output


def test_delta_switches_are_validated() -> None:
    with pytest.raises(ValueError, match="gate"):
        validate_params("kvcmas", {"gate": "sometimes"})
    assert validate_params("kvcomm", {"gate": "dense"})["gate"] == "dense"
    assert validate_params("kvcmas", {})["apply_corrections"] is True


def test_a_server_that_does_not_start_fails_its_methods_invariants_and_the_rest_go_on() -> None:
    """On a GPU whose attention backend hands the connector a cache it cannot read, that method's
    server stops at start-up with the connector's refusal: the table says so and names it."""
    import contextlib

    from kvbench.experiment.check_requests import CheckSpec
    from kvbench.experiment.method_check import run_checks, startup_failure
    from kvbench.methods.core.paged import UnsupportedCacheError, layout_for
    from kvbench.model.resolve import resolve_model
    from kvbench.server.errors import ServerError

    with pytest.raises(UnsupportedCacheError) as refused:  # an MLA latent cache, as vLLM's worker log shows it
        layout_for(torch.empty(512, 16, 576, device="meta"), None, "FLASHMLA")
    refusal = f"kvbench.methods.core.paged.UnsupportedCacheError: {refused.value}"

    @contextlib.contextmanager
    def servers(method: str):
        raise ServerError(f"vLLM exited with code 1 during start-up; log x.log:\nINFO loading\n{refusal}\nERROR engine died")
        yield ""

    started = []
    outcomes = run_checks(CheckSpec(model=resolve_model(None)), invariants_of(["cacheblend", "droidspeak"]), servers,
                          progress=started.append)
    assert [(o.method, o.status) for o in outcomes] == [("cacheblend", "fail"), ("droidspeak", "fail")]
    assert all(o.evidence == f"its server did not start: {refusal}" for o in outcomes)
    assert startup_failure("port 8000 is in use\nmore") == "port 8000 is in use"


def test_each_invariant_starts_from_an_empty_store_with_request_ids_no_earlier_check_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A server earlier runs used may hold an entry of the same content kept with another codec
    (PolyKV's lossy one), and vLLM's prefix cache is salted by the check's run ids: each invariant
    empties the store after setting its parameters, and two checks never share a run id."""
    from types import SimpleNamespace

    from kvbench.experiment.check_requests import CheckSpec
    from kvbench.experiment.invariants import Outcome
    from kvbench.experiment.method_check import ServerCheck

    calls: list[tuple] = []

    class Rpc:
        def info(self):
            return [SimpleNamespace(params={"store_codec": "polykv"})]

        def set_params(self, params):
            calls.append(("set_params", params))

        def reset(self, keep_method_state: bool = False):
            calls.append(("reset", keep_method_state))

    def evaluate(self, invariant):
        calls.append(("evaluate", self.run_id("method")))
        return Outcome(invariant.method, invariant.name, invariant.claim, "pass", "")

    monkeypatch.setattr(ServerCheck, "_evaluate", evaluate)
    server = SimpleNamespace(rpc=Rpc())
    identity = next(i for i in INVARIANTS if i.name == "identity-codec")
    checks = [ServerCheck(server, CheckSpec(model="m"), ModelFacts(2, "bfloat16"), None) for _ in range(2)]
    for check in checks:
        assert check.run(identity).status == "pass"
    first, second = calls[:4], calls[4:]
    assert [c[0] for c in first] == ["set_params", "reset", "evaluate", "set_params"]
    assert first[0] == ("set_params", {"store_codec": "identity"}) and first[1] == ("reset", False)
    assert first[3] == ("set_params", {"store_codec": "polykv"})  # the server's own parameters restored
    assert first[2][1] != second[2][1]  # each check's first run id: another salt for vLLM's prefix cache
