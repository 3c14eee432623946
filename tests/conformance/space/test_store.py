"""The stored covering arrays (`conformance/space/generated/`): one per area and profile, current.

A stale or missing file is not an error at run time: its rows are generated afresh, which costs
seconds for quick/standard and many minutes for the strength-3 full arrays (a CI run that selected
`full` spent its whole time limit regenerating one). So every file must carry the fingerprint of
the space it was generated from; regenerate with `python -m conformance.space quick standard full`.
"""

import json

import pytest

from conformance.catalogue import HANDWRITTEN
from conformance.space import profiles

CASES = [(area, profile) for area in profiles.AREAS for profile in profiles.STRENGTH]


def _stored(area, profile):
    path = profiles.STORE / f"{area}-{profile}.json"
    assert path.exists(), f"{path} missing: run `python -m conformance.space {profile}`"
    return json.loads(path.read_text())


@pytest.mark.parametrize(("area", "profile"), CASES)
def test_every_stored_array_carries_the_current_fingerprint(area, profile):
    stored = _stored(area, profile)
    pinned = profiles.pinned_rows(area, HANDWRITTEN[area](), profile)
    assert stored["fingerprint"] == profiles.key_of(area, profile, pinned), (
        f"{area}-{profile}.json is stale: run `python -m conformance.space {profile}`")


@pytest.mark.parametrize(("area", "profile"), [c for c in CASES if c[1] != "full"])
def test_the_stored_pairs_are_what_generation_gives(area, profile):
    # Catches a changed predicate under an old name (the fingerprint reads names, not code). The
    # strength-3 arrays take too long to regenerate in a test; their fingerprint is checked above.
    pinned = profiles.pinned_rows(area, HANDWRITTEN[area](), profile)
    assert _stored(area, profile)["rows"] == profiles.fresh_rows(area, profile, pinned)


@pytest.mark.parametrize(("area", "profile"), [c for c in CASES if c[1] != "quick"])
def test_the_stored_exclusions_are_what_the_constraints_give(area, profile):
    # Every report counts the excluded pairs from these (`space.coverage`): a stale or wrong
    # list would misstate every engine's pair coverage.
    from conformance.space.covering import excluded

    stored = _stored(area, profile).get("excluded_pairs")
    assert stored, f"{area}-{profile}.json holds no excluded pairs: run `python -m conformance.space {profile}`"
    space = profiles.AREAS[area].space(profile)
    assert stored["fingerprint"] == profiles.fingerprint(space, 2, ()), (
        f"{area}-{profile}.json's excluded pairs are stale: run `python -m conformance.space {profile}`")
    assert profiles.exclusions(area, profile) == excluded(space, 2)


def test_a_stale_exclusion_list_is_computed_afresh(tmp_path, monkeypatch):
    path = profiles.STORE / "bucketer-standard.json"
    data = json.loads(path.read_text())
    data["excluded_pairs"]["fingerprint"] = "stale"
    data["excluded_pairs"]["pairs"] = []
    (tmp_path / path.name).write_text(json.dumps(data))
    monkeypatch.setattr(profiles, "STORE", tmp_path)
    found = profiles.exclusions("bucketer", "standard")
    assert found and found == profiles.exclusions("bucketer", "quick")
