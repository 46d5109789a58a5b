"""Where the scheduler sent each request (scheduler_svc/placements.py): a dead detokenizer's requests
fail whether they still run or ended lately, since their last output may have died with it."""

from scheduler_svc.placements import Placements


def test_a_dead_detokenizers_running_and_lately_ended_requests_are_lost_others_not():
    p = Placements(keep_s=10)
    p.place("a", "g1", "d1")
    p.place("b", "g2", "d1")
    p.place("c", "g1", "d2")
    p.refresh({"a", "c"}, now=100)  # b ended here at about 100
    p.refresh({"a", "c"}, now=105)
    lost = dict(p.lost({"d2"}))
    assert {rid: (pl.gateway, pl.detokenizer) for rid, pl in lost.items()} == {"a": ("g1", "d1"), "b": ("g2", "d1")}
    assert p.lost({"d2"}) == []  # taken out: failed once


def test_requests_ended_longer_ago_than_keep_s_are_forgotten():
    p = Placements(keep_s=10)
    p.place("a", "g", "d")
    p.refresh(set(), now=0)
    p.refresh(set(), now=10)
    assert "a" in p.by_rid
    p.refresh(set(), now=10.5)
    assert p.lost(set()) == []
