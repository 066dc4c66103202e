"""Reports as a reader sees them: each method's report, the combined demo report and a 2-seed sweep report,
opened in headless Chromium at 1400 px. The claims come first after the title, every table-of-contents link
lands on its section, every image loads, and nothing is wider than the window outside a scroll box."""

import json

import pytest

from tests.report_browser import check_report, chromium_path, open_browser, problems

pytestmark = pytest.mark.skipif(
    chromium_path() is None,
    reason="no Chromium at /usr/bin/chromium (`make install` installs Debian's chromium)",
)

REPORTS = ["normic-tiny", "rote-fda-tiny", "otcclip-mosaic-tiny", "crl-tiny", "demo", "smoke-sweep"]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = open_browser(p)
        yield b
        b.close()


@pytest.mark.parametrize("name", REPORTS)
def test_report_reads_in_a_browser(micro_runs, browser, name):
    res = check_report(browser, micro_runs[name] / "report.html")
    assert not problems(res), problems(res)
    assert len(res["links"]) >= 3 and res["images"], res  # a real page: sections and figures
    if name == "demo":  # each method's section opens with that method's claims
        firsts = {s["id"]: s["firstChild"] for s in res["nested"]}
        md = (micro_runs["demo"] / "report.md").read_text()
        for recipe in ("normic-tiny", "rote-fda-tiny", "otcclip-mosaic-tiny", "crl-tiny"):
            assert firsts[recipe] == f"{recipe}-claims", firsts
            # the overview's verdict counts are this run's claims.json
            row = next(ln for ln in md.splitlines() if ln.startswith(f"| [{recipe}]"))
            counts = [int(c) for c in row.strip("| ").split(" | ")[2:]]
            verdicts = [
                c["verdict"] for c in json.loads((micro_runs[recipe] / "claims.json").read_text())["claims"]
            ]
            assert counts == [verdicts.count(v) for v in ("holds", "does not hold", "n/a")], row


def test_the_checks_catch_a_broken_page(browser, tmp_path):
    """The check fails on what it exists to catch (a wide element outside a scroll box, a broken image, a TOC
    link without a target or into a section that stays folded, claims not first)."""
    page = tmp_path / "bad.html"
    page.write_text(
        "<html><body><nav id='toc'><a href='#nowhere'>x</a><a href='#inside'>y</a></nav><main><h1>T</h1>"
        "<section id='other'><div style='display:none'><section id='inside'>z</section></div></section>"
        "<div style='width:3000px'>wide</div><img alt='gone' src='missing.png'></main>"
        "</body></html>"
    )
    bad = " | ".join(problems(check_report(browser, page)))
    for what in (
        "not the claims section",
        "#nowhere has no target",
        "wider than the window",
        "image not loaded",
        "#inside points into a folded section",  # hidden (Chromium itself opens a <details> on navigation)
    ):
        assert what in bad, bad
