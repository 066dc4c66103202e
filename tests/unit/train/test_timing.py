import time

from reprlab.train.timing import Timings, section, timing


def test_sections_nest_accumulate_and_sum_to_their_parent():
    with timing() as t:
        with section("a"):
            for _ in range(2):
                with section("b"):
                    time.sleep(0.01)
        with section("c"):
            pass
    rows = {r["path"]: r for r in t.rows()}
    assert list(rows) == ["a/b", "a", "c"]  # first-seen order: a child closes before its parent
    assert rows["a/b"]["calls"] == 2 and rows["a/b"]["depth"] == 1 and rows["a"]["calls"] == 1
    # sleeping costs wall time, not CPU time; a parent includes its children
    assert rows["a/b"]["wall_s"] >= 0.02 and rows["a"]["wall_s"] >= rows["a/b"]["wall_s"]
    assert rows["a/b"]["cpu_s"] < rows["a/b"]["wall_s"]
    assert abs(sum(r["cpu_share"] for r in rows.values() if r["depth"] == 0) - 1.0) < 1e-3


def test_section_without_an_active_timer_is_a_no_op():
    with section("x"):
        pass
    t = Timings()
    with timing(t):
        with section("y"):
            pass
    with section("z"):  # the timer is no longer active
        pass
    assert [r["path"] for r in t.rows()] == ["y"]
