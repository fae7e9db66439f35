"""The version check accepts a tested range: inside it silently, older (or known-broken)
refused in one line naming the fix, newer accepted with one warning per process."""

from __future__ import annotations

import warnings

import pytest

from megatron_grpo.platform import versions as V

RNG = V.TestedRange("megatron-core", tested=("0.16.1", "0.19.2"), known_broken={"0.18.0": "x"})


@pytest.mark.parametrize("found", ["0.16.1", "0.17.1", "0.19.2", "0.19.2+local"])
def test_inside_the_range_is_accepted_silently(found):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert V.check_range(RNG, "megatron-core", found) == found


@pytest.mark.parametrize("found", ["0.15.3", "0.16.0", "0.18.0"])
def test_older_or_known_broken_is_refused_in_one_line_naming_the_fix(found):
    with pytest.raises(V.VersionError) as e:
        V.check_range(RNG, "megatron-core", found)
    msg = str(e.value)
    assert "\n" not in msg and found in msg
    assert "pip install 'megatron-core>=0.16.1,<=0.19.2'" in msg


def test_newer_is_accepted_with_one_warning(monkeypatch):
    monkeypatch.setattr(V, "_warned", set())
    with pytest.warns(V.UntestedVersionWarning, match="0.20.0 is newer than the newest tested"):
        assert V.check_range(RNG, "megatron-core", "0.20.0") == "0.20.0"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        V.check_range(RNG, "megatron-core", "0.20.0")  # once per process


def test_installed_versions_are_inside_the_tested_ranges():
    # the environment the suite runs in is one of the tested ones
    assert V.check_megatron_core() in V.MEGATRON_CORE.tested
    assert V.check_vllm().split("+")[0] in V.VLLM.tested
