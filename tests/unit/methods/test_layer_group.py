"""DroidSpeak's layer-group choice from a layer-wise deviation profile (pure function)."""

from __future__ import annotations

import pytest

from kvbench.experiment.calibrate import layer_group


def test_group_width_follows_the_reuse_ratio() -> None:
    deviation = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    assert layer_group(deviation, 0.8) == (8, 10)  # 2 of 10 layers, the most deviating
    assert layer_group(deviation, 0.5) == (5, 10)
    assert layer_group(deviation, 0.95) == (8, 10)  # never narrower than 2: a 1-layer group changes nothing


def test_group_counts_only_the_layers_after_its_first() -> None:
    # Layer 3 deviates most, but a group starting there gets layer 3's K/V back: [2, 4) corrects it.
    assert layer_group([0.0, 0.1, 0.1, 0.9, 0.1, 0.1], 2 / 3) == (2, 4)
    # From layer 0 the group enters with token embeddings and every layer of it is exact.
    assert layer_group([0.5, 0.4, 0.0, 0.0], 0.5) == (0, 2)


@pytest.mark.parametrize(("rho", "group"), [(0.0, (0, 3)), (0.3, (1, 3))])
def test_group_never_exceeds_the_model(rho: float, group: tuple[int, int]) -> None:
    # rho 0.3 of 3 layers: 2 layers; [1, 3) corrects layer 2 (0.4), [0, 2) layers 0 and 1 (0.3).
    assert layer_group([0.1, 0.2, 0.4], rho) == group


def test_layer_selective_methods_reject_bad_parameters() -> None:
    from kvbench.methods.api.base import MethodConfigError
    from kvbench.methods.registry import method_class

    for bad in ([3, 1], [0], [-1, 2], [0.5, 2]):
        with pytest.raises(MethodConfigError, match=r"layers(\.0)?: .*(layers must be \[start, stop\)|valid integer)"):
            method_class("droidspeak")({"layers": bad})
    with pytest.raises(MethodConfigError, match="reuse_ratio: Input should be less than 1"):
        method_class("droidspeak")({"reuse_ratio": 1.0})
    with pytest.raises(MethodConfigError, match="start_layer .* must be <= det_layer"):
        method_class("relaycaching")({"start_layer": 2, "det_layer": 1})
    with pytest.raises(MethodConfigError, match="end_layer: Input should be greater than or equal to -1"):
        method_class("relaycaching")({"end_layer": -2})
    with pytest.raises(MethodConfigError, match="tau_inf: Input should be greater than or equal to 0"):
        method_class("relaycaching")({"tau_inf": -0.1})
    with pytest.raises(MethodConfigError, match="has no parameter"):
        method_class("relaycaching")({"tau": 0.3})
