"""Open reprlab reports in headless Chromium (Debian's ``chromium``, driven by playwright) and check them.

Used by ``tests/test_report_browser.py``; also a script that checks reports and keeps screenshots::

    python -m tests.report_browser runs/demo/normic-tiny/report.html --screenshot docs/figures/report_normic.png

Playwright never downloads a browser here: it drives the system Chromium (``REPRLAB_CHROMIUM`` or
``/usr/bin/chromium``, which ``make install`` installs), with the flags that keep it off the network.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

WIDTH, HEIGHT = 1400, 1000
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]  # fmt: skip

# Everything the checks read, measured in the page (all <details> opened for the width check).
_LAYOUT_JS = """() => {
  const main = document.querySelector('main');
  const h1 = main && main.querySelector(':scope > h1');
  const first = h1 && h1.nextElementSibling;
  const nested = [...document.querySelectorAll('main > section')].map(s => {
    const body = s.querySelector(':scope > details > .body');
    const child = body && body.querySelector(':scope > section');
    return {id: s.id, firstChild: child ? child.id : null};
  });
  document.querySelectorAll('details').forEach(d => d.open = true);
  const vw = document.documentElement.clientWidth;
  const wide = [];
  for (const el of document.body.querySelectorAll('*')) {
    const r = el.getBoundingClientRect();
    if (r.width === 0 || (r.right <= vw + 1 && r.left >= -1)) continue;
    let p = el.parentElement, boxed = false;
    for (; p && p !== document.body; p = p.parentElement) {
      const o = getComputedStyle(p).overflowX;
      if (o === 'auto' || o === 'scroll' || o === 'hidden') { boxed = true; break; }
    }
    if (!boxed) wide.push(el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') +
                          (el.className && typeof el.className === 'string' ? '.' + el.className : '') +
                          ' right=' + Math.round(r.right));
  }
  return {first: first ? {tag: first.tagName.toLowerCase(), id: first.id} : null, nested,
          wide: wide.slice(0, 10), pageWidth: document.documentElement.scrollWidth, viewport: vw,
          images: [...document.images].map(i => ({alt: i.alt, ok: i.complete && i.naturalWidth > 0}))};
}"""

# Click every table-of-contents link as a reader would (one after another, from wherever the last one left
# the page) and record where its target ended up; waits a task and two frames after each click so the
# page's own hashchange handler (which opens folded sections) has run.
_LINKS_JS = """async () => {
  const settle = () => new Promise(r => setTimeout(() => requestAnimationFrame(() => requestAnimationFrame(r)), 0));
  const out = {};
  for (const a of document.querySelectorAll('nav#toc a')) {
    const id = decodeURIComponent(a.getAttribute('href').slice(1));
    a.click();
    await settle();
    const t = document.getElementById(id);
    if (!t) { out[id] = {found: false}; continue; }
    const maxScroll = document.documentElement.scrollHeight - innerHeight;
    out[id] = {found: true, top: t.getBoundingClientRect().top, atBottom: scrollY >= maxScroll - 2,
               height: innerHeight, shown: t.getClientRects().length > 0};
  }
  return out;
}"""


def chromium_path() -> str | None:
    path = os.environ.get("REPRLAB_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    return path if Path(path).is_file() else None


def open_browser(playwright):
    return playwright.chromium.launch(executable_path=chromium_path(), args=FLAGS)


def check_report(browser, html: Path, screenshot: Path | None = None) -> dict:
    """Open ``html`` at 1400 px and return what the checks need; a screenshot of the first screen if asked.

    Returns ``{"first", "nested", "wide", "pageWidth", "viewport", "images", "links"}``: ``links`` maps every
    table-of-contents target to where it landed after a click (``top`` px from the window's top).
    """
    page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
    try:
        page.goto(Path(html).resolve().as_uri(), wait_until="load")
        if screenshot is not None:
            Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot))
        links = page.evaluate(_LINKS_JS)
        out = page.evaluate(_LAYOUT_JS)
        out["links"] = links
        return out
    finally:
        page.close()


def problems(result: dict) -> list[str]:
    """What is wrong with a checked report, in words (empty when it passes)."""
    bad = []
    if not result["first"] or result["first"] != {"tag": "section", "id": "claims"}:
        bad.append(f"the first thing after the title is {result['first']}, not the claims section")
    for href, landed in result["links"].items():
        if not landed["found"]:
            bad.append(f"TOC link #{href} has no target")
        elif not landed["shown"]:
            bad.append(f"TOC link #{href} points into a folded section that stays folded (not shown)")
        elif not (abs(landed["top"]) <= 2 or (landed["atBottom"] and 0 <= landed["top"] < landed["height"])):
            bad.append(f"TOC link #{href} landed {landed['top']:.0f} px from the top")
    if result["pageWidth"] > result["viewport"]:
        bad.append(f"the page is {result['pageWidth']} px wide in a {result['viewport']} px window")
    bad += [f"wider than the window outside a scroll box: {w}" for w in result["wide"]]
    bad += [f"image not loaded: {i['alt']}" for i in result["images"] if not i["ok"]]
    return bad


def main(argv: list[str]) -> int:
    from playwright.sync_api import sync_playwright

    pairs, i = [], 0
    while i < len(argv):
        shot = None
        if i + 2 < len(argv) and argv[i + 1] == "--screenshot":
            shot = Path(argv[i + 2])
        pairs.append((Path(argv[i]), shot))
        i += 3 if shot else 1
    failed = 0
    with sync_playwright() as p:
        browser = open_browser(p)
        for html, shot in pairs:
            res = check_report(browser, html, shot)
            bad = problems(res)
            failed += bool(bad)
            print(f"{html}: {len(res['links'])} TOC links, {len(res['images'])} images, "
                  + ("OK" if not bad else "; ".join(bad)) + (f"; screenshot {shot}" if shot else ""))  # fmt: skip
        browser.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
